"""Flash attention kernels in Mosaic GPU's CPU interpreter against the jnp reference.

Each case runs the forward kernel and both backward kernels (dQ; dK/dV) on random bf16
inputs and compares out, dq, dk, dv with float32 reference attention on the same inputs.
The cases cover every option and, pairwise, their combinations: causal or not, GQA ratios
1/2/4, head_dim 64/128/256 (256 takes the split dK/dV path), sliding window (with a middle of
unmasked blocks), softcap, custom scale, segment ids with padding, lengths that are not a
multiple of the tile. Interpreting is slow: shapes are as small as the tiles allow.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.flash_attention import kernel, ops, reference

# bf16 inputs and probabilities: errors land near 3e-3; a wrong mask gives > 5e-2.
TOL = 1e-2

CASES = {
  # name: (T, N, K, H, options)
  "causal-gqa2-pad": (200, 2, 1, 64, {}),
  "noncausal-mha": (136, 2, 2, 64, {"causal": False}),
  "window-3-ranges": (520, 2, 1, 64, {"window": 256}),
  "softcap-scale-gqa4": (200, 4, 1, 64, {"softcap": 5.0, "scale": 0.3}),
  "segments-window-softcap": (200, 2, 1, 64, {"segments": True, "window": 48, "softcap": 3.0}),
  "noncausal-segments-window": (200, 2, 1, 64, {"causal": False, "segments": True, "window": 50}),
  "h128-segments-gqa2": (130, 2, 1, 128, {"segments": True}),
  "one-segment-window": (330, 2, 1, 64, {"segments": "one", "window": 200}),
  "h256-softcap-window": (200, 2, 1, 256, {"softcap": 4.0, "window": 64}),
  "h256-segments-noncausal-gqa4": (128, 4, 1, 256, {"segments": True, "causal": False}),
  # dK products issued in their own step (Blocks(defer_dk=False)), not with the next step's
  "undeferred-segments-gqa2": (200, 2, 1, 64, {"defer_dk": False, "segments": True}),
}


def _inputs(t, n, kv, h, seed):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (1, t, n, h), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, t, kv, h), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, t, kv, h), jnp.bfloat16)
  do = jax.random.normal(ks[3], (1, t, n, h), jnp.bfloat16)
  # Packed documents, then padding (id 0) at the end, as data.py makes them.
  seg = jnp.sort(jax.random.randint(ks[4], (1, t), 1, 4), axis=1)
  seg = seg.at[:, t - t // 5 :].set(0)
  return q, k, v, do, seg


def _blocks(head_dim, defer_dk=None):
  """The head dim's blocks, with ``defer_dk`` if given."""
  blocks = kernel.Blocks.for_head_dim(head_dim)
  if defer_dk is None:
    return blocks
  return dataclasses.replace(blocks, defer_dk=defer_dk)


def _rel(x, ref):
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _errors(f, q, k, v, do):
  """Relative errors of (out, dq, dk, dv) from f against the float32 reference."""
  out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, "interpret"), q, k, v)
  up = lambda x: x.astype(jnp.float32)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: f(q, k, v, "xla"), up(q), up(k), up(v))
  got = (out, *vjp(do))
  want = (ref_out, *ref_vjp(up(do)))
  return [_rel(a, b) for a, b in zip(got, want, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(name):
  t, n, kv, h, opts = CASES[name]
  q, k, v, do, seg = _inputs(t, n, kv, h, seed=len(name))
  if not opts.get("segments"):
    seg = None
  kw = dict(
    segment_ids=jnp.ones_like(seg) if opts.get("segments") == "one" else seg,
    causal=opts.get("causal", True),
    window=opts.get("window", 0),
    softcap=opts.get("softcap"),
    scale=opts.get("scale"),
  )
  blocks = _blocks(h, opts.get("defer_dk"))
  f = lambda q, k, v, impl: ops.flash_attention(q, k, v, implementation=impl, blocks=blocks, **kw)
  errs = _errors(f, q, k, v, do)
  assert max(errs) < TOL, dict(zip(("out", "dq", "dk", "dv"), errs, strict=True))


@pytest.mark.slow
def test_traced_window_in_a_layer_scan():
  """The window is a per-layer int32 inside lax.scan (0 = full attention), as in the decoder."""
  q, k, v, do, seg = _inputs(200, 2, 1, 64, seed=3)
  windows = jnp.array([0, 40], jnp.int32)

  def layers(q, k, v, impl):
    def one(carry, w):
      out = ops.flash_attention(q, k, v, segment_ids=seg, window=w, implementation=impl)
      return carry + out.astype(jnp.float32), None

    return jax.lax.scan(one, jnp.zeros(q.shape, jnp.float32), windows)[0].astype(q.dtype)

  errs = _errors(jax.jit(layers, static_argnums=3), q, k, v, do)
  assert max(errs) < TOL, errs


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("everything", [False, True])
def test_kernels_lower_for_hopper(head_dim, everything):
  """Mosaic GPU lowering (layouts, shared-memory budget) runs without a GPU: catch it here."""
  q = jax.ShapeDtypeStruct((1, 1000, 4, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1000, 2, head_dim), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 1000), jnp.int32)
  window = jax.ShapeDtypeStruct((), jnp.int32)

  def f(q, k, v, do, seg, window):
    kw = dict(segment_ids=seg, window=window, softcap=30.0) if everything else {}
    blocks = _blocks(head_dim)
    attn = lambda q, k, v: ops.flash_attention(
      q, k, v, implementation="mosaic", blocks=blocks, **kw
    )
    out, vjp = jax.vjp(attn, q, k, v)
    return out, *vjp(do)

  text = jax.jit(f).trace(q, k, k, q, seg, window).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3  # forward, dQ, dK/dV


def test_tile_ranges_cover_exactly_the_visible_blocks():
  """The block ranges the kernels walk, against a brute-force mask (no interpreter)."""
  import numpy as np  # noqa: PLC0415

  for causal in (True, False):
    for window in (0, 1, 63, 64, 100, 300):
      opts = kernel.Options(seq_len=500, scale=1.0, causal=causal, windowed=window > 0)
      vis = np.array(reference.visible(512, causal=causal, window=window)[0])
      vis[:, 500:] = False
      for q0 in range(0, 512, 128):
        lo, a, b, hi = (int(x) for x in kernel._kv_blocks(opts, q0, q0 + 128, window, 64))
        rows = vis[q0 : q0 + 128]
        for j in range(8):
          blk = rows[:, j * 64 : (j + 1) * 64]
          assert (lo <= j < hi) == blk.any(), (causal, window, q0, j)
          if a <= j < b:
            assert blk.all(), (causal, window, q0, j)
      for k0 in range(0, 512, 128):
        lo, a, b, hi = (int(x) for x in kernel._q_blocks(opts, k0, k0 + 128, window, 64))
        cols = vis[:500, k0 : min(k0 + 128, 500)]  # dK/dV rows of padded keys are dropped
        for j in range(8):
          blk = cols[j * 64 : (j + 1) * 64]
          assert (lo <= j < hi) >= blk.any(), (causal, window, k0, j)
          if a <= j < b:
            assert blk.all(), (causal, window, k0, j)


def test_implementation_is_named_and_inputs_checked():
  q, k, v, _, seg = _inputs(64, 2, 1, 64, seed=1)
  # The caller names the implementation: the op never picks one.
  for missing in (None, "pallas"):
    with pytest.raises(ValueError, match="mosaic, interpret, cudnn, xla"):
      ops.flash_attention(q, k, v, implementation=missing)
  assert ops.mosaic_supports(jnp.bfloat16, 256) and ops.mosaic_supports(jnp.float16, 64)
  assert not ops.mosaic_supports(jnp.float32, 128) and not ops.mosaic_supports(jnp.bfloat16, 96)
  assert ops.cudnn_supports(segmented=False, softcap=None, window=16)
  assert not ops.cudnn_supports(segmented=True, softcap=None, window=0)
  assert not ops.cudnn_supports(segmented=False, softcap=30.0, window=0)

  def scanned_layer(window):  # a traced window, as in the decoder's layer scan: not for cuDNN
    assert not ops.cudnn_supports(segmented=False, softcap=None, window=window)
    return window

  jax.eval_shape(scanned_layer, jnp.int32(0))
  with pytest.raises(ValueError, match="bf16 or f16"):
    ops.flash_attention(q.astype(jnp.float32), k, v, implementation="interpret")
  with pytest.raises(ValueError, match="head_dim"):
    ops.flash_attention(q[..., :32], k[..., :32], v[..., :32], implementation="interpret")
  with pytest.raises(ValueError, match="cudnn"):
    ops.flash_attention(q, k, v, segment_ids=seg, implementation="cudnn")

"""Flash attention kernels in Mosaic GPU's CPU interpreter against the jnp reference.

Each case runs the forward kernel and both backward kernels (dQ; dK/dV) on random bf16
inputs and compares out, lse, dq, dk, dv with float32 reference attention on the same inputs,
the gradients taken through both outputs. The cases cover every option and, pairwise, their
combinations: causal or not, GQA ratios 1/2/4, head_dim 64/128/256 (256 takes the split dK/dV
path), sliding window (with a middle of unmasked blocks), softcap, custom scale, segment ids
with padding, keys with ids of their own (as in ring attention: some queries see no key),
lengths that are not a multiple of the tile. Interpreting is slow: shapes are as small as
the tiles allow.
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import background_run, run_cli

from pallas_kernels.flash_attention import kernel, ops, reference

# bf16 inputs and probabilities: errors land near 3e-3; a wrong mask gives > 5e-2.
TOL = 1e-2

CASES = {
  # name: (T, N, K, H, options); segments: True (3 packed documents), "many" (14), "one" (one
  # document), "kv" (packed, and keys with ids of their own)
  "causal-gqa4-pad": (200, 4, 1, 64, {}),
  "noncausal-mha-scale": (100, 2, 2, 64, {"causal": False, "scale": 0.3}),  # one tile
  "kv-segments-window-softcap-scale": (
    200,
    2,
    1,
    64,
    {"segments": "kv", "window": 48, "softcap": 3.0, "scale": 0.3},
  ),
  "noncausal-kv-window": (200, 2, 1, 64, {"causal": False, "segments": "kv", "window": 50}),
  # dK products issued in their own step (Blocks(defer_dk=False)), not with the next step's
  "h128-segments-gqa2-undeferred": (130, 2, 1, 128, {"segments": True, "defer_dk": False}),
  # A window whose edge, middle and diagonal are all met by one query tile in each kernel
  "one-segment-window": (330, 2, 1, 64, {"segments": "one", "window": 256}),
  "h256-softcap-window": (200, 2, 1, 256, {"softcap": 4.0, "window": 64}),
  "h256-kv-segments-noncausal-gqa4": (128, 4, 1, 256, {"segments": "kv", "causal": False}),
  # Short documents: every kernel skips the blocks of the documents before (and after) a tile's
  "many-segments-gqa2": (256, 2, 1, 64, {"segments": "many"}),
}


def _inputs(t, n, kv, h, seed, docs=3):
  ks = jax.random.split(jax.random.key(seed), 7)
  q = jax.random.normal(ks[0], (1, t, n, h), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, t, kv, h), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, t, kv, h), jnp.bfloat16)
  do = jax.random.normal(ks[3], (1, t, n, h), jnp.bfloat16)
  # As large as dP = dO . V, so that a wrong lse term in dS shows.
  dlse = jax.random.normal(ks[4], (1, n, t), jnp.float32) * h**0.5
  # Packed documents, then padding (id 0) at the end, as data.py makes them.
  seg = jnp.sort(jax.random.randint(ks[5], (1, t), 1, docs + 1), axis=1)
  seg = seg.at[:, t - t // 5 :].set(0)
  # Keys' own ids (ring attention): other document bounds, and no key of document 1.
  kv_seg = jnp.sort(jax.random.randint(ks[6], (1, t), 2, 5), axis=1)
  kv_seg = kv_seg.at[:, t - t // 5 :].set(0)
  return q, k, v, do, dlse, seg, kv_seg


def _blocks(head_dim, defer_dk=None):
  """The head dim's blocks, with ``defer_dk`` if given."""
  blocks = kernel.Blocks.for_head_dim(head_dim)
  if defer_dk is None:
    return blocks
  return dataclasses.replace(blocks, defer_dk=defer_dk)


def _rel(x, ref):
  """Relative error; where ref is -inf (the lse of a query that sees no key) x must be too."""
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  empty = ref == -jnp.inf
  if not jnp.array_equal(x == -jnp.inf, empty):
    return float("inf")
  x, ref = jnp.where(empty, 0.0, x), jnp.where(empty, 0.0, ref)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _compare(f, q, k, v, cotangent):
  """f's outputs then (dq, dk, dv) in the interpreter, and their relative errors against the
  float32 reference. f returns out, or (out, lse) with ``cotangent`` (do, dlse)."""
  out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, "interpret"), q, k, v)
  up = lambda x: jax.tree.map(lambda a: a.astype(jnp.float32), x)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: f(q, k, v, "xla"), up(q), up(k), up(v))
  got = (*jax.tree.leaves(out), *vjp(cotangent))
  want = (*jax.tree.leaves(ref_out), *ref_vjp(up(cotangent)))
  return got, [_rel(a, b) for a, b in zip(got, want, strict=True)]


def _case(name: str) -> dict:
  """One case's figures: the relative errors of out, lse, dq, dk, dv, and for keys with ids
  of their own (ring attention) the facts about queries that see no key."""
  t, n, kv, h, opts = CASES[name]
  segments = opts.get("segments")
  docs = 14 if segments == "many" else 3
  q, k, v, do, dlse, seg, kv_seg = _inputs(t, n, kv, h, seed=len(name), docs=docs)
  kw = dict(
    segment_ids=jnp.ones_like(seg) if segments == "one" else seg if segments else None,
    kv_segment_ids=kv_seg if segments == "kv" else None,
    causal=opts.get("causal", True),
    window=opts.get("window", 0),
    softcap=opts.get("softcap"),
    scale=opts.get("scale"),
  )
  blocks = _blocks(h, opts.get("defer_dk"))
  f = lambda q, k, v, impl: ops.flash_attention(
    q, k, v, implementation=impl, blocks=blocks, return_lse=True, **kw
  )
  if segments == "kv":
    vis = reference.visible(
      t, segment_ids=seg, kv_segment_ids=kv_seg, causal=kw["causal"], window=kw["window"]
    )
    sees = vis.any(axis=-1)[0]
    # A merge of blocks can send a row that sees nothing an overflowing lse cotangent
    # (logaddexp's exp(-total)): it must not reach the gradients (its P is 0).
    dlse = jnp.where(sees, dlse, jnp.inf)
  got, errs = _compare(f, q, k, v, (do, dlse))
  figures = {"errs": dict(zip(("out", "lse", "dq", "dk", "dv"), errs, strict=True))}
  if segments == "kv":
    out, lse, dq, dk, dv = got
    figures["blind"] = {
      "some queries see no key": bool(not sees.all()),
      "their out and dq are 0": bool((out[0, ~sees] == 0).all() and (dq[0, ~sees] == 0).all()),
      "their lse is -inf, the others' finite": bool(
        (lse[0][:, ~sees] == -jnp.inf).all() and jnp.isfinite(lse[0][:, sees]).all()
      ),
      "out and gradients finite": bool(all(jnp.isfinite(x).all() for x in (out, dq, dk, dv))),
    }
  return figures


@background_run("flash_cases")
def _flash_cases(directory, runs):
  """Every case of CASES in a process of its own, beside the other tests (the interpreter
  is what costs, ~10 s a case): {name: _case(name)}."""
  out = directory / "cases.json"
  code = (  # tests/ (conftest) beside this folder
    "import sys; sys.path.insert(0, '..'); "
    "import test_flash_attention as t; t._write_cases(sys.argv[1])"
  )
  proc = run_cli([sys.executable, "-c", code, str(out)], timeout=900, cwd=Path(__file__).parent)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def _write_cases(path: str) -> None:
  Path(path).write_text(json.dumps({name: _case(name) for name in CASES}))


@pytest.mark.slow
@pytest.mark.late
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(name, flash_cases):
  figures = flash_cases[name]
  assert all(e < TOL for e in figures["errs"].values()), figures["errs"]
  if CASES[name][4].get("segments") == "kv":
    assert all(figures["blind"].values()), figures["blind"]


@pytest.mark.beside
@pytest.mark.slow
def test_traced_window_in_a_layer_scan():
  """The window is a per-layer int32 inside lax.scan (0 = full attention), as in the decoder;
  without return_lse, the default."""
  q, k, v, do, _, seg, _ = _inputs(130, 2, 1, 64, seed=3)  # 3 tiles of 64 tokens, one ragged
  windows = jnp.array([0, 40], jnp.int32)

  def layers(q, k, v, impl):
    def one(carry, w):
      out = ops.flash_attention(q, k, v, segment_ids=seg, window=w, implementation=impl)
      return carry + out.astype(jnp.float32), None

    return jax.lax.scan(one, jnp.zeros(q.shape, jnp.float32), windows)[0].astype(q.dtype)

  _, errs = _compare(jax.jit(layers, static_argnums=3), q, k, v, do)
  assert all(e < TOL for e in errs), errs


def test_reference_against_a_formula_per_query():
  """The reference's out, lse and their gradients against attention written query by query
  over the keys it sees, with keys' ids that leave some queries no key."""
  t, n, h, window, cap, scale = 10, 2, 8, 4, 2.0, 0.5
  rng = np.random.default_rng(0)
  q, k, v, do = (rng.standard_normal((1, t, heads, h), np.float32) for heads in (n, 1, 1, n))
  dlse = rng.standard_normal((1, n, t), np.float32)
  seg = [1, 1, 1, 1, 1, 2, 2, 2, 2, 2]
  kv_seg = [2, 2, 1, 1, 1, 1, 1, 3, 2, 2]  # queries 0, 1, 5-7 see nothing
  sees = lambda i: [j for j in range(i + 1) if i - j < window and seg[i] == kv_seg[j]]

  def per_query(q, k, v):
    out, lse = [jnp.zeros((n, h))] * t, [jnp.full((n,), -jnp.inf)] * t
    for i in range(t):
      if js := sees(i):
        s = cap * jnp.tanh(scale * q[0, i] @ k[0, js, 0].T / cap)  # [N, keys]
        lse[i] = jax.scipy.special.logsumexp(s, axis=1)
        out[i] = jax.nn.softmax(s, axis=1) @ v[0, js, 0]
    return jnp.stack(out)[None], jnp.stack(lse, axis=1)[None]

  ref = lambda q, k, v: reference.attention(
    q, k, v, segment_ids=jnp.array([seg]), kv_segment_ids=jnp.array([kv_seg]), window=window,
    softcap=cap, scale=scale, return_lse=True,
  )  # fmt: skip
  assert [i for i in range(t) if not sees(i)] == [0, 1, 5, 6, 7]

  @jax.jit
  def outputs_and_grads(q, k, v):
    (out, lse), vjp = jax.vjp(ref, q, k, v)
    (want_out, want_lse), want_vjp = jax.vjp(per_query, q, k, v)
    return (out, lse, *vjp((do, dlse))), (want_out, want_lse, *want_vjp((do, dlse)))

  got, want = outputs_and_grads(q, k, v)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # -inf where b is


@pytest.mark.parametrize(
  "head_dim, everything", [(64, True), (128, True), (256, True), (128, False)]
)
@pytest.mark.slow
def test_kernels_lower_for_hopper(head_dim, everything):
  """Mosaic GPU lowering (layouts, shared-memory budget) runs without a GPU: catch it here.
  Every head dim's blocks with every option (segments, window, softcap, lse: the most shared
  memory), and the plain kernels once."""
  q = jax.ShapeDtypeStruct((1, 1000, 4, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1000, 2, head_dim), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, 1000), jnp.int32)
  lse = jax.ShapeDtypeStruct((1, 4, 1000), jnp.float32)
  window = jax.ShapeDtypeStruct((), jnp.int32)

  def f(q, k, v, do, dlse, seg, kv_seg, window):
    kw = {}
    if everything:
      kw = dict(segment_ids=seg, kv_segment_ids=kv_seg, window=window, softcap=30.0)
    blocks = _blocks(head_dim)
    attn = lambda q, k, v: ops.flash_attention(
      q, k, v, implementation="mosaic", blocks=blocks, return_lse=everything, **kw
    )
    out, vjp = jax.vjp(attn, q, k, v)
    return out, *vjp((do, dlse) if everything else do)

  traced = jax.jit(f).trace(q, k, k, q, lse, seg, seg, window)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3  # forward, dQ, dK/dV


def test_tile_ranges_cover_exactly_the_visible_blocks():
  """The block ranges the kernels walk, against a brute-force mask (no interpreter)."""
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


def test_packed_rows_walk_only_their_documents_blocks():
  """With segment ids the ranges narrow to the blocks of a tile's own documents: every block
  holding a visible pair is still walked, and the first (forward, dQ) or last (dK/dV) block
  walked holds one (no interpreter)."""
  lengths = [70, 200, 30, 150, 14]  # then padding (id 0) to 512
  seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
  seg = jnp.asarray(np.pad(seg, (0, 512 - seg.size))[None], jnp.int32)
  spans = ops._segment_spans(seg)
  opts = kernel.Options(seq_len=512, scale=1.0, causal=True, segmented=True)
  vis = np.array(reference.visible(512, segment_ids=seg, causal=True)[0])
  skipped = 0
  for q0 in range(0, 512, 128):
    ranges = kernel._kv_blocks(opts, q0, q0 + 128, 0, 64)
    lo, a, b, hi = (int(x) for x in kernel._narrow_kv(opts, spans, 0, q0, 128, 64, ranges))
    rows = vis[q0 : q0 + 128]
    assert lo <= a <= b <= hi and rows[:, lo * 64 : (lo + 1) * 64].any(), q0
    for j in range(8):
      assert not rows[:, j * 64 : (j + 1) * 64].any() or lo <= j < hi, (q0, j)
    skipped += lo - int(ranges[0])
  for k0 in range(0, 512, 128):
    ranges = kernel._q_blocks(opts, k0, k0 + 128, 0, 64)
    lo, a, b, hi = (int(x) for x in kernel._narrow_q(opts, spans, 0, k0, 128, 64, ranges))
    cols = vis[:, k0 : k0 + 128]
    assert lo <= a <= b <= hi and cols[(hi - 1) * 64 : hi * 64].any(), k0
    for j in range(8):
      assert not cols[j * 64 : (j + 1) * 64].any() or lo <= j < hi, (k0, j)
    skipped += int(ranges[3]) - hi
  assert skipped >= 6  # blocks of other documents the causal ranges alone would walk


def test_implementation_is_named_and_inputs_checked():
  q, k, v, _, _, seg, _ = _inputs(64, 2, 1, 64, seed=1)
  # The caller names the implementation: the op never picks one.
  for missing in (None, "pallas"):
    with pytest.raises(ValueError, match="mosaic, interpret, cudnn, xla"):
      ops.flash_attention(q, k, v, implementation=missing)
  assert ops.mosaic_supports(jnp.bfloat16, 256) and ops.mosaic_supports(jnp.float16, 64)
  assert not ops.mosaic_supports(jnp.float32, 128) and not ops.mosaic_supports(jnp.bfloat16, 96)
  assert ops.cudnn_supports(segmented=False, softcap=None, window=16)
  assert not ops.cudnn_supports(segmented=True, softcap=None, window=0)
  assert not ops.cudnn_supports(segmented=False, softcap=30.0, window=0)
  assert not ops.cudnn_supports(segmented=False, softcap=None, window=0, return_lse=True)

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
  with pytest.raises(ValueError, match="return_lse"):
    ops.flash_attention(q, k, v, return_lse=True, implementation="cudnn")
  with pytest.raises(ValueError, match="pass both"):
    ops.flash_attention(q, k, v, kv_segment_ids=seg, implementation="xla")

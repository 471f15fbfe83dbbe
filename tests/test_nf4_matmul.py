"""The NF4 dequant-matmul kernels under Mosaic GPU's interpreter, against the jnp reference.

The interpreter runs the kernels' tiling, pipelining, scales and wgmma with the "select" lookup
and the dequantized tile staged in shared memory; the "prmt" lookup (inline PTX) cannot run on
a CPU, so its byte-permute program is checked here by emulating prmt on every possible byte.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune import nf4
from jaxtune.nf4_maps import NF4_CODE
from pallas_kernels import _gpu
from pallas_kernels.nf4_matmul import kernel, nf4_matmul, nf4_matmul_reference


def _weights(rng, n, k):
  return nf4.quantize_linear(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))


def _rel(got, ref):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  return np.linalg.norm(got - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize(
  "lead, k, n",
  [((1,), 128, 128), ((70,), 192, 256), ((2, 5), 128, 64)],
  ids=["one-token", "ragged-rows", "batched-one-warpgroup"],
)
def test_forward_matches_reference(lead, k, n):
  rng = np.random.default_rng(len(lead) * 1000 + k + n)
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.bfloat16)
  ref = np.asarray(nf4_matmul_reference(x, *q))
  got = nf4_matmul(x, *q, impl="interpret")
  assert got.shape == (*lead, n) and got.dtype == jnp.bfloat16
  assert _rel(got, ref) < 1e-2


@pytest.mark.parametrize(
  "cfg, k",
  [
    (kernel.Config(block_m=16, compute_wgs=2, split_k=2, a_from_smem=True), 256),
    (kernel.Config(block_m=32, compute_wgs=1, k_sub=2, a_from_smem=True), 256),
    (kernel.Config(block_m=16, compute_wgs=2, split_k=2, k_sub=4, a_from_smem=True), 1024),
  ],
  ids=["split-k", "two-k-blocks-per-step", "split-k-four-k-blocks-per-step"],
)
def test_forward_configs(cfg, k):
  rng = np.random.default_rng(3)
  m, n = 32, 128
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w4, scales = kernel.kernel_operands(*q, swap_nibbles=True)
  interpret = _gpu.interpret_params()
  got = kernel.forward(x, w4, scales, config=cfg, lookup="select", interpret=interpret)
  assert _rel(got, np.asarray(nf4_matmul_reference(x, *q))) < 1e-2


@pytest.mark.parametrize(
  "cfg",
  [
    kernel.Config(block_m=64, block_n=64, block_k_out=64, compute_wgs=2),
    kernel.Config(block_m=64, block_n=128, block_k_out=128, compute_wgs=1),
  ],
  ids=["two-warpgroups", "wide-tiles"],
)
def test_backward_kernel(cfg):
  rng = np.random.default_rng(4)
  m, n, k = 64, 128, 256
  q = _weights(rng, n, k)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  w4, scales = kernel.kernel_operands(*q, swap_nibbles=True)
  got = kernel.backward(
    dy, w4, scales, config=cfg, lookup="select", interpret=_gpu.interpret_params()
  )
  ref = np.asarray(dy, np.float32) @ np.asarray(nf4.dequantize_linear(*q, jnp.float32))
  assert _rel(got, ref) < 1e-2


def test_gradient_matches_reference():
  rng = np.random.default_rng(5)
  k, n = 128, 256
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((3, 7, k)), jnp.bfloat16)
  probe = jnp.asarray(rng.standard_normal((n,)), jnp.float32)

  def loss(x, fn):
    return jnp.sum(fn(x).astype(jnp.float32) * probe)

  got = jax.grad(loss)(x, lambda x: nf4_matmul(x, *q, impl="interpret"))
  ref = jax.grad(loss)(x.astype(jnp.float32), lambda x: nf4_matmul_reference(x, *q))
  assert got.dtype == jnp.bfloat16
  assert _rel(got, np.asarray(ref)) < 1e-2


def test_xla_fallback_is_exact_dequantize_then_dot_and_default_off_gpu():
  rng = np.random.default_rng(6)
  q = _weights(rng, 64, 128)
  x = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
  ref = np.asarray(nf4_matmul_reference(x, *q))
  np.testing.assert_allclose(np.asarray(nf4_matmul(x, *q)), ref, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="impl must be one of"):
    nf4_matmul(x, *q, impl="cuda")


def _prmt(a: int, b: int, selector: int) -> int:
  """PTX prmt.b32 in its default mode (sign-replicate bit clear in every selector nibble)."""
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  return sum(pool[(selector >> (4 * j)) & 7] << (8 * j) for j in range(4))


def test_prmt_lookup_program_on_every_byte():
  """The GPU lookup's seven permutes give bnb's element order and NF4 levels in bfloat16."""
  lo, hi = kernel._table_words()
  want = np.asarray(NF4_CODE, np.float32).astype(jnp.bfloat16).view(np.uint16)
  for byte in range(256):
    sel = byte & kernel.SEL_MASK
    blend = ((byte & kernel.BLEND_MASK) >> 1) | kernel.BLEND_BASE
    lows = _prmt(_prmt(lo[0], lo[1], sel), _prmt(lo[2], lo[3], sel), blend)
    highs = _prmt(_prmt(hi[0], hi[1], sel), _prmt(hi[2], hi[3], sel), blend)
    pair = _prmt(lows, highs, kernel.INTERLEAVE)
    # bitsandbytes: the even element sits in the high nibble and comes first.
    assert pair & 0xFFFF == want[byte >> 4] and pair >> 16 == want[byte & 15], byte


def test_decoding_dispatch_takes_the_swept_configurations():
  """At decoding sizes dispatch splits K to a cell per SM and takes the most k blocks per
  step that leave 4 steps: the fastest configurations of experiments/sweep_nf4_decode.py
  (H100, 8B shapes, M = 1 and 16): (split, k blocks) = (8, 2), (2, 4), (8, 4); at M = 64 half
  the cells and the most blocks that fit in shared memory: (4, 2), (1, 4), (4, 2)."""
  from pallas_kernels.nf4_matmul import ops

  for (k, n), want in {(4096, 4096): (8, 2), (4096, 14336): (2, 4), (14336, 4096): (8, 4)}.items():
    for m in (1, 16):
      cfg = ops._forward_config(m, n, k, interpret=False)
      assert (cfg.block_m, cfg.split_k, cfg.k_sub) == (16, *want), (m, k, n)
  # 64 tokens (GRPO's rollouts of 8 x 8): the sweep's fastest at M = 64 is half the cells.
  for (k, n), want in {(4096, 4096): (4, 2), (4096, 14336): (1, 4), (14336, 4096): (4, 2)}.items():
    cfg = ops._forward_config(64, n, k, interpret=False)
    assert (cfg.block_m, cfg.split_k, cfg.k_sub) == (64, *want), (k, n)
  assert ops._forward_config(4096, 4096, 4096, interpret=False).k_sub == 1  # training tiles


def test_dispatched_forward_configurations_fit_in_shared_memory():
  """Every configuration dispatch can pick for the 8B and 70B projections fits in Hopper's
  shared memory, counted by kernel.forward_smem_bytes; that count is not below what Mosaic GPU
  asked for on an H100 (241,728 bytes: 64 tokens, 4 k blocks a step, split K, 2 warpgroups:
  the GRPO rollout that failed), and 4 k blocks are still taken where they fit."""
  from pallas_kernels.nf4_matmul import ops

  failed = kernel.Config(block_m=64, compute_wgs=2, split_k=2, k_sub=4)
  assert kernel.forward_smem_bytes(failed) >= 241_728 > kernel.SMEM_BYTES
  shapes = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]  # 8B (K, N)
  shapes += [(8192, 8192), (8192, 1024), (8192, 28672), (28672, 8192)]  # 70B
  subs = set()
  for (k, n), m in itertools.product(shapes, (1, 8, 16, 17, 32, 33, 48, 64, 65, 4096)):
    cfg = ops._forward_config(m, n, k, interpret=False)
    assert kernel.forward_smem_bytes(cfg) <= kernel.SMEM_BYTES, (m, k, n, cfg)
    subs.add((cfg.block_m, cfg.k_sub))
  assert (64, 2) in subs and (16, 4) in subs and (32, 4) in subs, subs


def test_prepared_scales_give_the_same_products():
  """Decoding makes the kernel's scales once (kernel_scales, stacked over layers) and passes
  them to every call: the same values as the kernel makes per call, so the same products."""
  from pallas_kernels.nf4_matmul import kernel_scales

  rng = np.random.default_rng(8)
  layers = [_weights(rng, 128, 256) for _ in range(2)]
  stacked = [jnp.stack(parts) for parts in zip(*layers, strict=True)]
  prepared = kernel_scales(*stacked[1:])  # [L, K/64, N]
  assert prepared.shape == (2, 4, 128) and prepared.dtype == jnp.bfloat16
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  for i, q in enumerate(layers):
    _, per_call = kernel.kernel_operands(*q, swap_nibbles=False)
    np.testing.assert_array_equal(np.asarray(prepared[i]), np.asarray(per_call))
  q = layers[1]
  want = nf4_matmul(x, *q, impl="interpret")
  got = nf4_matmul(x, *q, impl="interpret", scales=prepared[1])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

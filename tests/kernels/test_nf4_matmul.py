"""The NF4 dequant-matmul kernels under Mosaic GPU's interpreter, against the jnp reference.

The interpreter runs the kernels' tiling, pipelining, scales and wgmma with the "select" lookup
and the dequantized tile staged in shared memory; the "prmt" and "word" lookups (inline PTX)
cannot run on a CPU, so their permute programs are checked here by emulating PTX, and the
"word" path's data movement (codes permuted in memory, loaded in one register layout, looked
up into another) by emulating Mosaic GPU's layouts from their definitions.
"""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _gpu, nf4
from pallas_kernels.nf4_maps import NF4_CODE
from pallas_kernels.nf4_matmul import (
  configs,
  kernel,
  kernel_scales,
  lookups,
  nf4_matmul,
  nf4_matmul_reference,
  ops,
  reference,
)


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
@pytest.mark.slow
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
    (kernel.Config(block_m=16, compute_wgs=2, k_sub=2, delay_release=1, a_from_smem=True), 512),
    (
      kernel.Config(
        block_m=16, compute_wgs=4, split_k=2, k_sub=2, delay_release=1, a_from_smem=True
      ),
      1024,
    ),  # fmt: skip
    # Training tiles store y, not y^T (each warpgroup's tile transposed into shared memory),
    # here in 4 chunks of 8 tokens through two buffers, each reused.
    (kernel.Config(block_m=32, compute_wgs=2, out_rows=True, out_chunk=8, a_from_smem=True), 256),
    # The grid walked in groups of tile rows: 4 x 2 tiles in 2 groups, out of launch order.
    (kernel.Config(block_m=8, compute_wgs=1, group_m=2, out_rows=True, a_from_smem=True), 256),
    # One group of every tile row (dispatch's 16 at 4,096 tokens): the grid column by column.
    (kernel.Config(block_m=8, compute_wgs=1, group_m=4, out_rows=True, a_from_smem=True), 256),
  ],
  ids=[
    "split-k",
    "two-k-blocks-per-step",
    "split-k-four-k-blocks-per-step",
    "wgmma-in-flight-across-steps",
    "four-compute-warpgroups",
    "output-stored-as-rows",
    "grid-in-groups-of-tile-rows",
    "grid-as-one-group-of-all-tile-rows",
  ],  # fmt: skip
)
@pytest.mark.slow
def test_forward_configs(cfg, k):
  rng = np.random.default_rng(3)
  m, n = 32, 2 * kernel.WG_ROWS * cfg.compute_wgs // min(cfg.compute_wgs, 2)
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w4, scales = kernel.kernel_operands(*q, swap_nibbles=True)
  interpret = _gpu.interpret_params()
  got = kernel.forward(x, w4, scales, config=cfg, lookup="select", interpret=interpret)
  assert _rel(got, np.asarray(nf4_matmul_reference(x, *q))) < 1e-2


@pytest.mark.slow
def test_blocks_as_columns_multiply_one_token():
  """One token spread over the columns (spread_blocks: row c holds the k blocks b with b % sub
  == c, so the rows add back to x; the kernel spreads it) and multiplied by unscaled tiles,
  each column scaled after the product: the reference's product, one row; what the kernel
  refuses in that mode (more than one row, a wider tile)."""
  # Decoding's 4 k blocks a step, K split in 2 (dispatch's one-token configurations).
  sub, split, k = 4, 2, 1024
  rng = np.random.default_rng(18)
  n = 2 * kernel.WG_ROWS
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
  spread = kernel.spread_blocks(x, sub)
  assert spread.shape == (kernel.COLUMNS, k)
  np.testing.assert_array_equal(np.asarray(spread, np.float32).sum(0), np.asarray(x[0], np.float32))
  blocks = np.arange(k) // 64
  assert (np.asarray(spread)[(blocks[None] % sub) != np.arange(8)[:, None]] == 0).all()
  cfg = kernel.Config(
    block_m=kernel.COLUMNS, compute_wgs=2, split_k=split, k_sub=sub, blocks_as_columns=True,
    a_from_smem=True, max_concurrent_steps=2,
  )  # fmt: skip
  w4, scales = kernel.kernel_operands(*q, swap_nibbles=True)
  interpret = _gpu.interpret_params()
  got = kernel.forward(x, w4, scales, config=cfg, lookup="select", interpret=interpret)
  assert got.shape == (1, n)
  assert _rel(got, np.asarray(nf4_matmul_reference(x, *q))) < 1e-2
  for bad_x, bad in ((spread, cfg), (x, dataclasses.replace(cfg, block_m=16))):
    with pytest.raises(ValueError, match="blocks_as_columns takes one token"):
      kernel.forward(bad_x, w4, scales, config=bad, lookup="select")
  with pytest.raises(ValueError, match="one row"):
    kernel.spread_blocks(jnp.zeros((2, k), jnp.bfloat16), sub)


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


@pytest.mark.slow
def test_input_gradient_through_the_forward_kernel_on_transposed_codes():
  """dy @ W as the forward kernel on W^T's codes with W's scales along the tile's columns
  (``Config.transposed``): the register-operand path for the input gradient; two warpgroups,
  two cells of rows, two k blocks a step, K split in two."""
  cfg = kernel.Config(
    block_m=16, compute_wgs=2, k_sub=2, split_k=2, transposed=True, a_from_smem=True
  )
  rng = np.random.default_rng(6)
  m, n, k = 32, 256, 256  # dy [m, n], W [n, k]
  q = _weights(rng, n, k)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  wt = kernel.kernel_codes(reference.transposed_codes(q[0]), swap_nibbles=True)
  interpret = _gpu.interpret_params()
  got = kernel.forward(
    dy, wt, kernel_scales(*q[1:]), config=cfg, lookup="select", interpret=interpret
  )
  ref = np.asarray(dy, np.float32) @ np.asarray(nf4.dequantize_linear(*q, jnp.float32))
  assert got.shape == (m, k) and _rel(got, ref) < 1e-2


@pytest.mark.slow
def test_input_gradient_from_operands_made_for_the_run(monkeypatch):
  """The op's input gradient on the interpreted transposed kernel reading W^T's codes made
  once (``training_operands``, word order, put back for the interpreter's lookup), at a
  training size lowered to 32 tokens: the reference's gradient."""
  monkeypatch.setattr(configs, "WORD_PER_CALL_MIN_TOKENS", 32)  # the configurations'
  monkeypatch.setattr(ops, "WORD_PER_CALL_MIN_TOKENS", 32)  # the op's lookups'
  rng = np.random.default_rng(15)
  n, k = 128, 256
  q = _weights(rng, n, k)
  word, word_t, scales = ops.training_operands(*q)
  x = jnp.asarray(rng.standard_normal((32, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((32, n)), jnp.bfloat16)
  call = lambda x: nf4_matmul(  # noqa: E731
    x, *q, impl="interpret", word_codes=word, word_codes_t=word_t, scales=scales
  )
  assert ops._backward_config(32, n, k).transposed
  _, vjp = jax.vjp(call, x)
  (dx,) = vjp(dy)
  ref = np.asarray(dy, np.float32) @ np.asarray(nf4.dequantize_linear(*q, jnp.float32))
  assert dx.shape == (32, k) and _rel(dx, ref) < 1e-2


def test_backward_kernel_gets_no_table_lookup(monkeypatch):
  """At training sizes where K does not tile the transposed forward (960 = 7.5 x 128), the
  input gradient runs the backward kernel, which reads no table: "word", not the forward's
  training lookup (whose fallback there would be lut, which that kernel refuses)."""
  seen = {}

  def backward(dy, w4, scales, *, config, lookup, interpret):
    seen.update(lookup=lookup, config=config)
    return jnp.zeros((dy.shape[0], w4.shape[1]), dy.dtype)

  monkeypatch.setattr(kernel, "backward", backward)
  q = _weights(np.random.default_rng(16), 128, 960)
  ops._bwd_impl("kernel", jnp.zeros((2048, 128), jnp.bfloat16), q)
  assert not seen["config"].transposed and seen["lookup"] == "word"


def test_transposed_codes_are_the_transposed_weights_codes():
  codes = np.random.default_rng(12).integers(0, 256, (2, 64, 48), dtype=np.uint8)
  got = np.asarray(reference.transposed_codes(jnp.asarray(codes)))
  assert got.shape == (2, 96, 32)
  for b in range(2):
    np.testing.assert_array_equal(_logical_codes(got[b]), _logical_codes(codes[b]).T)


@pytest.mark.slow
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


def test_extra_columns_fold_into_the_product_with_their_gradients():
  """nf4_matmul(extra=(e, v)) = x W^T + e v^T, differentiable in x, e and v, as XLA's one dot
  over [x, e] and [W, v] (a LoRA folded into the frozen product)."""
  rng = np.random.default_rng(8)
  k, n, r = 128, 96, 6
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((2, 5, k)), jnp.float32)
  e = jnp.asarray(rng.standard_normal((2, 5, r)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((n, r)), jnp.float32)
  probe = jnp.asarray(rng.standard_normal((n,)), jnp.float32)

  def folded(x, e, v):
    return jnp.sum(nf4_matmul(x, *q, impl="xla", extra=(e, v)) * probe)

  def apart(x, e, v):
    return jnp.sum((nf4_matmul_reference(x, *q) + e @ v.T) * probe)

  y = nf4_matmul(x, *q, impl="xla", extra=(e, v))
  assert _rel(y, np.asarray(nf4_matmul_reference(x, *q) + e @ v.T)) < 1e-6
  got = jax.grad(folded, (0, 1, 2))(x, e, v)
  ref = jax.grad(apart, (0, 1, 2))(x, e, v)
  for g, want in zip(got, ref, strict=True):
    assert _rel(g, np.asarray(want)) < 1e-6
  text = jax.jit(folded).lower(x, e, v).as_text()
  assert re.search(rf"dot_general.*tensor<10x{k + r}xf32>", text), "not one dot over K + r"


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [3, 1], ids=["in-the-kernel", "added-to-one-token"])
def test_extra_columns_beside_the_kernel_are_added_with_their_gradients(tokens, monkeypatch):
  """Where the kernel runs (here its interpreter, bfloat16), the extra pair's product is the
  kernel's own (one more wgmma into each tile, its 4 columns padded to 16) or, for one token
  (its k blocks as the accumulator's columns; so too where K is split), added to its product;
  either way differentiated as on XLA's path."""
  rng = np.random.default_rng(9)
  k, n, r = 128, 128, 4
  assert ops._forward_config(tokens, n, k, interpret=True).blocks_as_columns == (tokens == 1)
  q = _weights(rng, n, k)
  x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
  e = jnp.asarray(rng.standard_normal((tokens, r)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((n, r)), jnp.float32)
  probe = jnp.asarray(rng.standard_normal((n,)), jnp.float32)

  def loss(x, e, v, impl):
    y = nf4_matmul(x, *q, impl=impl, extra=(e, v))
    return jnp.sum(y.astype(jnp.float32) * probe)

  calls = []
  forward = kernel.forward

  def spy(*args, extra=None, **kw):
    calls.append(extra)
    return forward(*args, extra=extra, **kw)

  monkeypatch.setattr(kernel, "forward", spy)
  y = nf4_matmul(x, *q, impl="interpret", extra=(e, v))
  assert [c is not None for c in calls] == [tokens > 1]  # the pair went into the kernel, or not
  assert _rel(y, np.asarray(nf4_matmul(x, *q, impl="xla", extra=(e, v)), np.float32)) < 1e-2
  got = jax.grad(loss, (0, 1, 2))(x, e, v, "interpret")
  want = jax.grad(loss, (0, 1, 2))(x, e, v, "xla")
  for g, w in zip(got, want, strict=True):
    assert g.dtype == w.dtype
    assert _rel(g, np.asarray(w, np.float32)) < 1e-2


@pytest.mark.slow
def test_dequantizing_again_in_the_backward_keeps_no_weight_from_the_recomputed_forward():
  """Under full remat XLA would share each dequantized weight between the recomputed forward
  product and the input gradient, so all of a block's weights wait together; with
  dequantize_again each is made after its dy, and the compiled plan holds at least one
  dequantized weight less (on XLA:CPU 1.75). The gradients are the same values."""
  rng = np.random.default_rng(7)
  d, f, tokens = 256, 1024, 256
  ws = [_weights(rng, f, d), _weights(rng, f, d), _weights(rng, d, f)]  # gate, up, down
  x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)

  def grad_fn(again):
    def block(x):
      mm = lambda x, w: nf4_matmul(x, *w, impl="xla", dequantize_again=again)  # noqa: E731
      return mm(jax.nn.silu(mm(x, ws[0])) * mm(x, ws[1]), ws[2])

    block = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.jit(jax.grad(lambda x: jnp.sum(block(block(x)).astype(jnp.float32))))

  plans, grads = {}, {}
  for again in (False, True):
    fn = grad_fn(again)
    plans[again] = fn.lower(x).compile().memory_analysis().temp_size_in_bytes
    grads[again] = np.asarray(fn(x).astype(jnp.float32))
  weight_bytes = f * d * 2  # one dequantized bf16 weight
  assert plans[False] - plans[True] >= weight_bytes, plans
  np.testing.assert_array_equal(grads[True], grads[False])


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
  lo, hi = lookups._table_words()
  want = np.asarray(NF4_CODE, np.float32).astype(jnp.bfloat16).view(np.uint16)
  for byte in range(256):
    sel = byte & lookups.SEL_MASK
    blend = ((byte & lookups.BLEND_MASK) >> 1) | lookups.BLEND_BASE
    lows = _prmt(_prmt(lo[0], lo[1], sel), _prmt(lo[2], lo[3], sel), blend)
    highs = _prmt(_prmt(hi[0], hi[1], sel), _prmt(hi[2], hi[3], sel), blend)
    pair = _prmt(lows, highs, lookups.INTERLEAVE)
    # bitsandbytes: the even element sits in the high nibble and comes first.
    assert pair & 0xFFFF == want[byte >> 4] and pair >> 16 == want[byte & 15], byte


def test_decoding_dispatch_takes_the_swept_configurations():
  """At decoding sizes dispatch splits K to at most one wave of cells (four compute warpgroups
  where two would need more than a wave), takes the most k blocks per step that leave 4
  steps, wgmmas in flight into the next step: the fastest configurations measured
  (experiments/RESULTS.md, H100, decoding's 8B launches); at M = 64 half the cells and the
  most blocks that fit in shared memory: (4, 2), (1, 4), (4, 2)."""
  from pallas_kernels.nf4_matmul import ops

  decode = {  # (K, N): (warpgroups, split, k blocks a step); at most one wave of cells
    (4096, 4096): (2, 4, 4), (4096, 6144): (2, 2, 4), (14336, 4096): (2, 4, 4),
    (4096, 28672): (4, 1, 4),  # two warpgroups: 224 cells, more than a wave
  }  # fmt: skip
  for (k, n), want in decode.items():
    cfg = ops._forward_config(16, n, k, interpret=False)
    assert (cfg.block_m, cfg.compute_wgs, cfg.split_k, cfg.k_sub) == (16, *want), (k, n)
    assert cfg.delay_release == 1  # wgmmas left in flight across steps (swept at M <= 16)
    assert not cfg.blocks_as_columns and cfg.max_concurrent_steps == 4
    # One token: the same grid, its k blocks as the 8 columns, 3 stages, nothing in flight.
    cfg = ops._forward_config(1, n, k, interpret=False)
    assert (cfg.block_m, cfg.compute_wgs, cfg.split_k, cfg.k_sub) == (8, *want), (k, n)
    assert cfg.blocks_as_columns and cfg.max_concurrent_steps == configs.COLUMN_STAGES == 3
    assert cfg.delay_release == 0
  cfg = ops._forward_config(1, 28672 + 128, 4096, interpret=False)  # 225 cells, N % 256 != 0
  assert (cfg.compute_wgs, cfg.split_k) == (2, 1)
  # 64 tokens (GRPO's rollouts of 8 x 8): the sweep's fastest at M = 64 is half the cells.
  for (k, n), want in {(4096, 4096): (4, 2), (4096, 14336): (1, 4), (14336, 4096): (4, 2)}.items():
    cfg = ops._forward_config(64, n, k, interpret=False)
    assert (cfg.block_m, cfg.split_k, cfg.k_sub, cfg.delay_release) == (64, *want, 0), (k, n)
  cfg = ops._forward_config(64, 28672, 4096, interpret=False)  # fused gate/up: 4 warpgroups
  assert (cfg.compute_wgs, cfg.split_k, cfg.k_sub) == (4, 1, 2)


def test_training_dispatch_takes_the_swept_configurations():
  """At training sizes (sweep_nf4_train.py, H100, 8B shapes at 4096 tokens): 256-token tiles,
  one k block a step, 4 stages, nothing left in flight, y stored as rows in chunks of 32 tokens
  (room for plut's table); the input gradient as the forward kernel on W^T's codes, the same
  way (256 x 64 tiles below 2048 tokens); the plut lookup on codes permuted per call from 2048
  tokens, its table beside the pipeline (prmt below, where the permutation costs more than it
  saves; the interpreter's own lookup always)."""
  cfg = ops._forward_config(4096, 4096, 4096, interpret=False)
  assert (cfg.block_m, cfg.k_sub, cfg.split_k, cfg.delay_release, cfg.out_rows) == (
    256, 1, 1, 0, True
  )  # fmt: skip
  assert (cfg.max_concurrent_steps, cfg.out_chunk) == (4, 32)
  assert cfg.group_m == 16  # the grid walks groups of 16 tile rows where they divide, else 8, 4
  assert ops._forward_config(8192, 4096, 4096, interpret=False).group_m == 16  # not 32
  assert ops._forward_config(4096 - 8 * 256, 4096, 4096, interpret=False).group_m == 8
  assert ops._forward_config(4096 - 4 * 256, 4096, 4096, interpret=False).group_m == 4
  assert ops._forward_config(4096 - 256, 4096, 4096, interpret=False).group_m == 1
  assert not ops._forward_config(128, 4096, 4096, interpret=False).out_rows  # not measured
  bwd = ops._backward_config(4096, 14336, 4096)  # the forward kernel on W^T's codes
  assert (bwd.block_m, bwd.compute_wgs, bwd.transposed, bwd.out_rows) == (256, 2, True, True)
  assert (bwd.group_m, bwd.max_concurrent_steps, bwd.out_chunk) == (16, 4, 32)
  for c in (cfg, bwd):
    assert ops._kernel_args("kernel", None, 4096, c)["lookup"] == "plut"
    assert kernel.forward_smem_bytes(c, lookup="plut") <= kernel.SMEM_BYTES
    # The whole tile's staging would leave no room for the table: word.
    whole = dataclasses.replace(c, out_chunk=0)
    assert ops._kernel_args("kernel", None, 4096, whole)["lookup"] == "word"
  assert ops._kernel_args("kernel", "lut", 4096, cfg)["lookup"] == "lut"
  bwd = ops._backward_config(1024, 14336, 4096)
  assert (bwd.block_m, bwd.block_n, bwd.block_k_out, bwd.transposed) == (256, 64, 64, False)
  small = ops._forward_config(256, 4096, 4096, interpret=False)
  assert ops._kernel_args("kernel", None, 256, small)["lookup"] == "prmt"
  assert ops._kernel_args("interpret", None, 4096, cfg)["lookup"] == "select"


@pytest.mark.parametrize("prepared", [False, True], ids=["permuted-per-call", "made-for-the-run"])
def test_training_calls_hand_the_kernels_word_order_codes(monkeypatch, prepared):
  """A 2048-token call forced onto the kernels (impl="kernel") hands the forward kernel
  word_codes' permutation of W's codes, and for the input gradient the forward kernel on W^T's
  (``Config.transposed``), both with the plut lookup and the configurations dispatch chose;
  the codes so read, dequantized as the GPU's plut path does (emulated), give the reference
  products. Made for the run (``ops.training_operands``), those very arrays reach the
  kernels."""
  rng = np.random.default_rng(14)
  n, k = 128, 256
  q = _weights(rng, n, k)
  made = ops.training_operands(*q) if prepared else (None, None, None)
  x = jnp.asarray(rng.standard_normal((2048, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((2048, n)), jnp.bfloat16)
  seen = {}

  def forward(x, w4, scales, *, config, lookup, interpret, extra=None):
    seen["bwd" if config.transposed else "fwd"] = dict(
      w4=w4, scales=scales, lookup=lookup, config=config
    )
    return jnp.zeros((x.shape[0], w4.shape[0]), x.dtype)

  monkeypatch.setattr(kernel, "forward", forward)
  monkeypatch.setattr(kernel, "backward", None)  # not called at this size
  word, word_t, scales = made
  call = lambda x: nf4_matmul(  # noqa: E731
    x, *q, impl="kernel", word_codes=word, word_codes_t=word_t, scales=scales
  )
  _, vjp = jax.vjp(call, x)
  jax.block_until_ready(vjp(dy))
  if prepared:
    for which, codes in (("fwd", word), ("bwd", word_t)):
      np.testing.assert_array_equal(
        np.asarray(seen[which]["w4"]), np.asarray(kernel.kernel_codes(codes, swap_nibbles=False))
      )
      np.testing.assert_array_equal(np.asarray(seen[which]["scales"]), np.asarray(scales))
  assert seen["fwd"]["config"] == ops._forward_config(2048, n, k, interpret=False)
  assert seen["bwd"]["config"] == ops._backward_config(2048, n, k)
  w32 = np.asarray(nf4.dequantize_linear(*q, jnp.float32))
  for which, a, want in (("fwd", x, lambda a: a @ w32.T), ("bwd", dy, lambda a: a @ w32)):
    got = seen[which]
    assert got["lookup"] == ops.TRAIN_LOOKUP == "plut", which
    levels = _dequant_word_tiles(got["w4"], "plut").astype(np.uint16).view(jnp.bfloat16)
    if which == "fwd":  # W [N, K], a scale per row and 64 columns
      scale = np.asarray(got["scales"]).T.repeat(64, axis=1)
    else:  # W^T [K, N], a scale per 64 rows and column
      scale = np.asarray(got["scales"]).repeat(64, axis=0)
    w = np.asarray((jnp.asarray(levels) * jnp.asarray(scale)).astype(jnp.float32))
    prod = np.asarray(a, np.float32) @ w.T
    assert _rel(prod, want(np.asarray(a, np.float32))) < 1e-2, which


def test_forward_refuses_rows_stored_from_split_products():
  """Stored as rows, a product split over K would be a float32 partial tile transposed,
  which Mosaic GPU does not lower: refused, here and under the interpreter alike."""
  x = jnp.zeros((16, 256), jnp.bfloat16)
  w4 = jnp.zeros((128, 256), jnp.int4)
  scales = jnp.zeros((4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="split_k 1"):
    kernel.forward(x, w4, scales, config=kernel.Config(block_m=16, split_k=2, out_rows=True))


def test_forward_refuses_wgmmas_in_flight_on_wide_tiles():
  """Wgmmas left in flight gave non-finite sums at 256-token tiles on an H100: the kernel
  refuses them beyond the 16 tokens where they measured exact (the interpreter, whose wgmma
  is synchronous, still runs them)."""
  x = jnp.zeros((32, 256), jnp.bfloat16)
  w4 = jnp.zeros((128, 256), jnp.int4)
  scales = jnp.zeros((4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="delay_release"):
    kernel.forward(x, w4, scales, config=kernel.Config(block_m=32, delay_release=1))


def test_dispatched_forward_configurations_fit_in_shared_memory():
  """Every configuration dispatch can pick for the 8B and 70B projections fits in Hopper's
  shared memory, counted by kernel.forward_smem_bytes; that count is not below what Mosaic GPU
  asked for on an H100 (241,728 bytes: 64 tokens, 4 k blocks a step, split K, 2 warpgroups:
  the GRPO rollout that failed), and 4 k blocks are still taken where they fit."""
  from pallas_kernels.nf4_matmul import ops

  failed = kernel.Config(block_m=64, compute_wgs=2, split_k=2, k_sub=4)
  # Measured with an 8 KiB staging tile the kernel no longer allocates where it is unused.
  assert kernel.forward_smem_bytes(failed) >= 241_728 - 8192 > kernel.SMEM_BYTES
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


# --- The "word" lookup ------------------------------------------------------------------------

_BF16_NF4 = np.asarray(NF4_CODE, np.float32).astype(jnp.bfloat16).view(np.uint16)


def _prmt_words(a, b, c):
  """PTX prmt.b32 in its default mode, elementwise over uint32 arrays; a selector nibble with
  bit 3 set replicates the sign of the byte it picks."""
  pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
  shape = np.broadcast(a, b, c).shape
  pool = np.stack([np.broadcast_to(byte, shape) for byte in pool])
  out = np.zeros(shape, np.uint64)
  for j in range(4):
    nib = np.broadcast_to((c >> (4 * j)) & 0xF, shape)
    byte = np.take_along_axis(pool, (nib & 7)[None].astype(np.int64), 0)[0]
    byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
    out |= byte.astype(np.uint64) << (8 * j)
  return out


def _lop3(a, b, c, lut):
  """PTX lop3.b32: bit i of the result is bit (4 a_i + 2 b_i + c_i) of ``lut``."""
  out = np.zeros(np.broadcast(a, b, c).shape, np.uint64)
  for i in range(32):
    index = ((a >> i) & 1) * 4 + ((b >> i) & 1) * 2 + ((c >> i) & 1)
    out |= ((np.uint64(lut) >> index) & 1) << np.uint64(i)
  return out


def _run_ptx(asm: str, inputs: dict, outputs: int, shared=None, loads=None):
  """Runs the inline PTX text ``asm`` over uint32 arrays: only the instructions the lookups use
  (another one fails the test); ``inputs`` maps operands like "$4" to arrays. ``shared``:
  (address, uint32 words) of shared memory for ld.shared, which must read whole words inside
  it; the word index of every load is appended to ``loads``."""
  regs = {k: np.asarray(v, np.uint64) for k, v in inputs.items()}
  ops = {
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: a << b,
    "add.u32": lambda a, b: a + b,
    "lop3.b32": _lop3,
    "prmt.b32": _prmt_words,
  }
  for line in asm.splitlines():
    line = line.strip()
    if line in ("{", "}") or line.startswith(".reg"):
      continue
    op, args = re.fullmatch(r"(\S+)\s+(.*);", line).groups()
    dst, *srcs = [t.strip() for t in args.split(",")]
    if op == "ld.shared.b32":
      base, words = shared
      offset = regs[re.fullmatch(r"\[(\S+)\]", srcs[0]).group(1)].astype(np.int64) - base
      assert (offset % 4 == 0).all() and (offset >= 0).all() and (offset < 4 * words.size).all()
      loads.append(offset // 4)
      regs[dst] = words.reshape(-1)[offset // 4].astype(np.uint64)
      continue
    vals = [regs[t] if t in regs else np.uint64(int(t, 0)) for t in srcs]
    regs[dst] = ops[op](*vals) & 0xFFFFFFFF
  return [regs[f"${i}"] for i in range(outputs)]


def test_word_lookup_program_on_every_half_word():
  """The word program (its PTX text as the kernel emits it) gives, for each byte b of the
  word, the bf16 pair [level of the high nibble, level of the low nibble]: bitsandbytes'
  even element first. Every 16-bit value appears in both halves of some word."""
  halves = np.arange(2**16, dtype=np.uint64)
  words = (halves << 16) | np.random.default_rng(9).permutation(halves)
  words = np.concatenate([words, np.asarray([0, 0xFFFFFFFF, 0x88888888, 0x77777777], np.uint64)])
  outs = _run_ptx(lookups.word_asm(), {"$4": words}, outputs=4)
  for b, pair in enumerate(outs):
    even, odd = (words >> (8 * b + 4)) & 15, (words >> (8 * b)) & 15
    np.testing.assert_array_equal(pair & 0xFFFF, _BF16_NF4[even], err_msg=f"byte {b}")
    np.testing.assert_array_equal(pair >> 16, _BF16_NF4[odd], err_msg=f"byte {b}")


def _layout_elements(layout, shape):
  """[thread, *register index, vector element] -> (row, col) for a Mosaic GPU TiledLayout,
  from its definition: an element's index after the tiling gives its warp and lane (the warp
  and lane dims, major to minor), its place in a register (the vector dim), and with those
  dims zeroed its register index."""
  tiled = layout.tiling.tile_shape(shape)
  regs = layout.registers_shape(shape)
  out = np.full((128, *regs, tiled[layout.vector_dim], 2), -1)

  def linear(t, dims):
    index = 0
    for d in dims:
      assert isinstance(d, int), d  # no replicated dims in these layouts
      index = index * tiled[d] + t[d]
    return index

  for r, c in np.ndindex(*shape):
    t = list(layout.tiling.tile_indices((r, c)))
    thread = 32 * linear(t, layout.warp_dims) + linear(t, layout.lane_dims)
    v = t[layout.vector_dim]
    for d in (*layout.warp_dims, *layout.lane_dims, layout.vector_dim):
      t[d] = 0
    assert (out[(thread, *t, v)] == -1).all()
    out[(thread, *t, v)] = (r, c)
  assert (out >= 0).all()
  return out


_WGMMA = plgpu.Layout.WGMMA.to_mgpu()
_UPCAST_4X = plgpu.Layout.WGMMA_UPCAST_4X.to_mgpu()


def _mosaic_thread_idxs(layout, shape):
  """What Mosaic GPU's own ``TiledLayout.thread_idxs`` (the index arithmetic it emits) gives
  each thread's registers: built as MLIR for a constant thread index and folded."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir, passmanager
  from jax._src.lib.mlir.dialects import arith, func
  from jax.experimental.mosaic import gpu as mgpu

  real = mgpu.utils.thread_idx
  with mlir.make_ir_context(), ir.Location.unknown():
    module = ir.Module.create()
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    per_thread = int(np.prod(layout.registers_shape(shape))) * len(shape)
    with ir.InsertionPoint(module.body):
      f = func.FuncOp("f", ir.FunctionType.get([], [index] * (128 * per_thread)))
      with ir.InsertionPoint(f.add_entry_block()):
        values = []
        try:
          for thread in range(128):
            mgpu.utils.thread_idx = lambda thread=thread: arith.constant(i32, thread)
            values += [v for idx in layout.thread_idxs(shape) for v in idx]
        finally:
          mgpu.utils.thread_idx = real
        func.ReturnOp(values)
    passmanager.PassManager.parse("builtin.module(canonicalize)").run(module.operation)
    ret = list(f.entry_block.operations)[-1]
    got = [ir.IntegerAttr(v.owner.attributes["value"]).value for v in ret.operands]
  return np.asarray(got).reshape(128, *layout.registers_shape(shape), len(shape))


@pytest.mark.parametrize("layout", [_WGMMA, _UPCAST_4X], ids=["wgmma", "upcast-4x"])
def test_layout_emulation_matches_mosaic_and_ptx(layout):
  """The emulation of both layouts agrees with the index arithmetic Mosaic GPU emits for each
  thread, and with the documented assignments: PTX ISA's wgmma A fragment (thread t of warp w
  holds rows 16w + t/4 (+8), columns 2(t%4), +1 of each 8) and Mosaic's UPCAST_4X (each of
  the 4 threads of a row holds 8 adjacent columns of each 32, in order)."""
  shape = (64, 64)
  emu = _layout_elements(layout, shape)
  np.testing.assert_array_equal(emu[..., 0, :], _mosaic_thread_idxs(layout, shape))
  width = 2 if layout == _WGMMA else 8  # adjacent columns a thread holds
  held = emu.reshape(128, -1, 2)
  for t in range(128):
    rows = [16 * (t // 32) + (t % 32) // 4 + 8 * h for h in (0, 1)]
    cols = [c for c in range(64) if c % (4 * width) // width == t % 4]
    assert set(map(tuple, held[t].tolist())) == set(itertools.product(rows, cols)), t


def test_column_scales_load_each_registers_two_adjacent_columns():
  """The GPU path of kernel._column_scales loads, for each WGMMA register of the [64, 8]
  accumulator, the scales of the element Mosaic GPU's thread_idxs names and of the column after
  it: a register's two elements are exactly those (emulated layout), for every thread."""
  shape = (kernel.WG_ROWS, kernel.COLUMNS)
  emu = _layout_elements(_WGMMA, shape)  # [thread, *register index, element, (row, col)]
  np.testing.assert_array_equal(emu[..., 0, :], _mosaic_thread_idxs(_WGMMA, shape))
  np.testing.assert_array_equal(emu[..., 1, 0], emu[..., 0, 0])
  np.testing.assert_array_equal(emu[..., 1, 1], emu[..., 0, 1] + 1)


_LUT_BASE = 0x2A000  # a shared-memory address for the "lut" table in the emulations


def _run_lut(words: np.ndarray, lanes: np.ndarray, lookup: str = "lut"):
  """The "lut" (or "plut") program over code words, each run by a lane of ``lanes`` (same
  shape), its table at ``_LUT_BASE``: its 4 pairs, and whether every load read the lane's own
  bank."""
  loads = []
  outs = _run_ptx(
    lookups.lut_asm() if lookup == "lut" else lookups.plut_asm(),
    {"$4": words, "$5": lanes.astype(np.uint64) * 4, "$6": np.uint64(_LUT_BASE)},
    outputs=4,
    shared=(_LUT_BASE, lookups.lookup_table(lookup)),
    loads=loads,
  )
  own_bank = all(np.array_equal(index % 32, lanes) for index in loads) and len(loads) == 4
  return outs, own_bank


def _dequant_word_tiles(w4: np.ndarray, program: str = "word") -> np.ndarray:
  """bf16 bits [N, K] the "word" path makes of w4 int4 [N, K], emulated tile by tile: each
  thread's WGMMA_UPCAST_4X registers read from the stored tile (vector element v in bits 4v),
  the word program (or with ``program`` "lut" or "plut", that table program, each thread as its
  lane), its
  pairs placed by ``lookups.word_register`` at their WGMMA_LAYOUT positions."""
  nib = np.asarray(jnp.asarray(w4).astype(jnp.int8)).astype(np.int64) & 15
  src, dst = _layout_elements(_UPCAST_4X, (64, 64)), _layout_elements(_WGMMA, (64, 64))
  out = np.full(nib.shape, -1, np.int64)
  for n0, k0 in itertools.product(range(0, nib.shape[0], 64), range(0, nib.shape[1], 64)):
    tile = nib[n0 : n0 + 64, k0 : k0 + 64]
    words = np.zeros(src.shape[:-2], np.uint64)
    for v in range(src.shape[-2]):
      words |= tile[src[..., v, 0], src[..., v, 1]].astype(np.uint64) << np.uint64(4 * v)
    if program in lookups.TABLE_LOOKUPS:
      lanes = np.broadcast_to(
        (np.arange(128) % 32).reshape(-1, *[1] * (words.ndim - 1)), words.shape
      )
      pairs, own_bank = _run_lut(words, lanes, program)
      assert own_bank
    else:
      pairs = _run_ptx(lookups.word_asm(), {"$4": words}, outputs=4)
    got = np.full((64, 64), -1, np.int64)
    for thread in range(128):
      for idx in np.ndindex(*words.shape[1:]):
        for p, pair in enumerate(pairs):
          for e, (r, c) in enumerate(dst[(thread, *lookups.word_register(idx, p))]):
            assert got[r, c] == -1, (thread, idx, p)
            got[r, c] = (int(pair[(thread, *idx)]) >> (16 * e)) & 0xFFFF
    out[n0 : n0 + 64, k0 : k0 + 64] = got
  assert (out >= 0).all()
  return out


def _logical_codes(codes) -> np.ndarray:
  """bitsandbytes' bytes [N, K/2] -> codes [N, K], element 2j from byte j's high nibble."""
  codes = np.asarray(codes)
  return np.stack([codes >> 4, codes & 15], axis=-1).reshape(codes.shape[0], -1)


def test_word_path_dequantizes_a_tile():
  """A [64, 64] tile through the whole word path (permuted in memory by word_codes, loaded,
  looked up, placed in wgmma's registers) is the logical tile's NF4 levels."""
  codes = np.random.default_rng(10).integers(0, 256, (64, 32), dtype=np.uint8)
  got = _dequant_word_tiles(kernel.word_codes(jnp.asarray(codes)))
  np.testing.assert_array_equal(got, _BF16_NF4[_logical_codes(codes)])


@pytest.mark.parametrize("lookup", lookups.TABLE_LOOKUPS)
def test_lut_program_on_every_half_word_reads_its_lanes_bank(lookup):
  """The lut and plut programs (their PTX text, run over the kernel's table in emulated shared
  memory) give for each byte of a word the bf16 pair [level of the high nibble, level of the
  low nibble], every 16-bit value in both halves of some word, each load in the bank of the
  lane that makes it (no conflicts)."""
  halves = np.arange(2**16, dtype=np.uint64)
  words = (halves << 16) | np.random.default_rng(16).permutation(halves)
  words = np.concatenate([words, np.asarray([0, 0xFFFFFFFF, 0x88888888, 0x77777777], np.uint64)])
  lanes = np.arange(words.size) % 32
  outs, own_bank = _run_lut(words, lanes, lookup)
  assert own_bank
  for b, pair in enumerate(outs):
    even, odd = (words >> (8 * b + 4)) & 15, (words >> (8 * b)) & 15
    np.testing.assert_array_equal(pair & 0xFFFF, _BF16_NF4[even], err_msg=f"byte {b}")
    np.testing.assert_array_equal(pair >> 16, _BF16_NF4[odd], err_msg=f"byte {b}")


@pytest.mark.parametrize("lookup", lookups.TABLE_LOOKUPS)
def test_lut_path_dequantizes_a_tile(lookup):
  """A [64, 64] tile through the lut or plut path (the word order in memory, loaded, each
  byte's pair read from the table, placed in wgmma's registers) is the logical tile's NF4
  levels."""
  codes = np.random.default_rng(17).integers(0, 256, (64, 32), dtype=np.uint8)
  got = _dequant_word_tiles(kernel.word_codes(jnp.asarray(codes)), program=lookup)
  np.testing.assert_array_equal(got, _BF16_NF4[_logical_codes(codes)])


@pytest.mark.slow
def test_lut_kernel_lowers_with_its_table_and_refuses_what_does_not_fit():
  """Decoding's and training's dispatched configurations lower for the GPU with the lut and
  plut lookups (Mosaic GPU's lowering runs on the CPU), the table a kernel input; a
  configuration whose shared memory cannot also hold the table is refused with its reason."""
  cases = [("lut", 1, 4096, 28672), ("lut", 16, 14336, 4096), ("plut", 16, 4096, 6144)]
  cases += [("plut", 1, 4096, 6144)]  # one token: blocks as columns, scaled after the product
  # Training: y stored in chunks; the input gradient (W^T's codes, W's scales along columns);
  # gate/up's LoRA pair (E = 32 at rank 16) in the kernel, its tiles where y is staged: lut.
  cases += [("plut", 4096, 4096, 14336), ("plut", -4096, 14336, 4096), ("lut", 4096, 4096, 14336)]
  for lookup, m, k, n in cases:
    e = 32 if lookup == "lut" and m == 4096 else 0
    if m < 0:  # dx [m, n] = dy [m, k] @ W, W [k, n]: the forward kernel on W^T's codes
      cfg = ops._backward_config(-m, k, n)
      scales = jax.ShapeDtypeStruct((n // 64, k), jnp.bfloat16)
    else:
      cfg = ops._forward_config(m, n, k, False)
      scales = jax.ShapeDtypeStruct((k // 64, n), jnp.bfloat16)
    assert kernel.forward_smem_bytes(cfg, lookup=lookup, extra_cols=e) <= kernel.SMEM_BYTES
    if e:  # dispatch's lookup with the pair: plut does not fit beside it
      assert ops._kernel_args("kernel", None, m, cfg, e)["lookup"] == "lut"
    rows = 1 if cfg.blocks_as_columns else cfg.block_m * cfg.group_m
    args = (
      jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
      jax.ShapeDtypeStruct((n, k), jnp.int4),
      scales,
    )
    pair = [jax.ShapeDtypeStruct((r, e), jnp.bfloat16) for r in (rows, n)] if e else []

    def f(x, w, s, *pair, cfg=cfg, lookup=lookup):
      return kernel.forward(x, w, s, config=cfg, lookup=lookup, extra=tuple(pair) or None)

    text = jax.jit(f).trace(*args, *pair).lower(lowering_platforms=("cuda",)).as_text()
    assert "ld.shared.b32" in text, (m, k, n)  # the table program
    assert ("prmt.b32" in text) == (lookup == "plut"), (m, k, n)
    call = next(line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line)
    table = "tensor<256x32xui32>" if lookup == "lut" else "tensor<256x64xui32>"
    # x (with blocks_as_columns: spread first), w4, scales, the pair; the table.
    want = (2 if cfg.blocks_as_columns else 3) + 2 * bool(e)
    assert call.count("%arg") == want and table in text
  # Fits in shared memory without the table (216,064 bytes), not with it.
  wide = kernel.Config(block_m=64, compute_wgs=2, k_sub=4)
  assert kernel.forward_smem_bytes(wide) <= kernel.SMEM_BYTES
  assert kernel.forward_smem_bytes(wide, lookup="lut") - kernel.forward_smem_bytes(wide) == 32768
  assert kernel.forward_smem_bytes(wide, lookup="plut") - kernel.forward_smem_bytes(wide) == 65536
  x = jnp.zeros((64, 1024), jnp.bfloat16)
  w4 = jnp.zeros((128, 1024), jnp.int4)
  scales = jnp.zeros((16, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="table does not fit"):
    kernel.forward(x, w4, scales, config=wide, lookup="lut")
  # A pair too wide for the staging's memory is refused (dispatch adds its product instead).
  pair = (jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((128, 128), jnp.bfloat16))
  with pytest.raises(ValueError, match="extra operands .128 columns. do not fit"):
    kernel.forward(x, w4, scales, config=wide, lookup="word", extra=pair)
  assert not ops._folds(wide, 128) and ops._folds(wide, 16)
  narrow = kernel.Config(block_m=16, compute_wgs=2, k_sub=2, a_from_smem=True)
  with pytest.raises(ValueError, match="runs on the GPU only"):
    kernel.forward(
      x[:16], w4, scales, config=narrow, lookup="lut", interpret=_gpu.interpret_params()
    )
  with pytest.raises(ValueError, match="forward kernel's only"):
    kernel.backward(x, w4, scales, config=kernel.Config(block_m=64), lookup="lut")


def test_word_bytes_transpose_every_16_bytes_as_4_by_4():
  """The word order on 32-bit words equals the 4 x 4 byte transpose it stands for, with
  leading dimensions, and is its own inverse."""
  codes = np.random.default_rng(15).integers(0, 256, (2, 3, 5, 48), dtype=np.uint8)
  want = codes.reshape(2, 3, 5, 3, 4, 4).swapaxes(-1, -2).reshape(codes.shape)
  got = np.asarray(jax.jit(ops.word_codes)(jnp.asarray(codes)))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(ops.word_codes(jnp.asarray(got))), codes)


def test_word_codes_is_a_jittable_permutation_within_32_columns():
  codes = np.random.default_rng(11).integers(0, 256, (2, 3, 128), dtype=np.uint8)
  got = jax.jit(kernel.word_codes)(jnp.asarray(codes))
  assert got.shape == (2, 3, 256) and got.dtype == jnp.int4
  stored = np.asarray(got.astype(jnp.int8)).astype(np.int64) & 15
  logical = _logical_codes(codes.reshape(6, 128)).reshape(2, 3, 8, 32)
  np.testing.assert_array_equal(np.sort(stored.reshape(2, 3, 8, 32)), np.sort(logical))
  assert not np.array_equal(stored.reshape(logical.shape), logical)
  with pytest.raises(ValueError, match="multiple of 32"):
    kernel.word_codes(jnp.zeros((4, 24), jnp.uint8))


def test_kernel_word_lookup_gets_operands_that_multiply_right(monkeypatch):
  """nf4_matmul(..., impl="kernel", lookup="word") hands the forward kernel word_codes' codes
  and the scales; dequantized the way the word path does it on the GPU (emulated above) and
  multiplied, they give the reference product. Off the kernel, lookup is refused."""
  rng = np.random.default_rng(12)
  q = _weights(rng, 128, 256)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  seen = {}

  def forward(x, w4, scales, *, config, lookup, interpret, extra=None):
    seen.update(w4=w4, scales=scales, lookup=lookup, config=config)
    return jnp.zeros((x.shape[0], w4.shape[0]), x.dtype)

  monkeypatch.setattr(kernel, "forward", forward)
  jax.block_until_ready(nf4_matmul(x, *q, impl="kernel", lookup="word"))
  assert seen["lookup"] == "word" and seen["config"].split_k >= 1
  levels = _dequant_word_tiles(seen["w4"]).astype(np.uint16).view(jnp.bfloat16)
  scale = np.asarray(seen["scales"]).T.repeat(64, axis=1)  # [N, K]
  w = (jnp.asarray(levels) * jnp.asarray(scale)).astype(jnp.float32)  # bf16 product, as the kernel
  got = np.asarray(x, np.float32) @ np.asarray(w).T
  assert _rel(got, np.asarray(nf4_matmul_reference(x, *q))) < 1e-2
  # Codes prepared once (decoding: ops.word_codes, uint8 so a layer stack slices cheaply)
  # reach the kernel as the same int4 tile, with decoding's lookup for them ("plut", whose
  # emulated path makes the same levels of them).
  word_at_call = seen.pop("w4")
  prepared = ops.word_codes(jnp.stack([q[0], q[0][::-1]]))  # [L, N, K/2], a layer stack
  assert prepared.dtype == jnp.uint8 and prepared.shape == (2, *q[0].shape)
  jax.block_until_ready(nf4_matmul(x, *q, impl="kernel", word_codes=prepared[0]))
  assert seen["lookup"] == ops.PREPARED_LOOKUP == "plut"
  np.testing.assert_array_equal(np.asarray(seen["w4"]), np.asarray(word_at_call))
  lut_levels = _dequant_word_tiles(seen["w4"], program="plut").astype(np.uint16)
  np.testing.assert_array_equal(lut_levels, levels.view(np.uint16))
  # 16-token tiles of four warpgroups (8B gate/up) have room for lut's table, not plut's.
  n_wide = 28672
  codes_wide = jnp.zeros((n_wide, 2048), jnp.uint8)
  jax.block_until_ready(
    ops.prepared_matmul(
      jnp.zeros((16, 4096), jnp.bfloat16), codes_wide, jnp.zeros((64, n_wide), jnp.bfloat16),
      impl="kernel",
    )
  )  # fmt: skip
  assert seen["config"].compute_wgs == 4 and seen["lookup"] == "lut"
  # Wider tiles keep the word lookup (the table is measured and sized for decoding's tiles).
  jax.block_until_ready(nf4_matmul(jnp.tile(x, (40, 1)), *q, impl="kernel", word_codes=prepared[0]))
  assert seen["config"].block_m == 128 and seen["lookup"] == "word"
  for impl in ("interpret", "xla"):
    with pytest.raises(ValueError, match="lookup must be one of"):
      nf4_matmul(x, *q, impl=impl, lookup="word")
  with pytest.raises(ValueError, match="lookup must be one of"):
    nf4_matmul(x, *q, impl="kernel", lookup="select")


def test_prepared_matmul_runs_weights_of_one_input_as_one():
  """q/k/v-like weights concatenated along N as prepared operands (word-order codes, bf16
  scales): the interpreted kernel and XLA's twin both give each weight's product in its
  columns, ragged rows included; the word order is a transpose, so undone by itself."""
  rng = np.random.default_rng(13)
  k = 128
  qs = [_weights(rng, n, k) for n in (128, 64, 64)]
  codes = jnp.concatenate([q[0] for q in qs])
  np.testing.assert_array_equal(ops.word_codes(ops.word_codes(codes)), codes)
  word = ops.word_codes(codes)
  scales = jnp.concatenate([ops.kernel_scales(*q[1:]) for q in qs], axis=-1)
  x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
  ref = np.concatenate([np.asarray(nf4_matmul_reference(x, *q)) for q in qs], axis=-1)
  xla = ops.prepared_matmul(x, word, scales, impl="xla")
  got = ops.prepared_matmul(x, word, scales, impl="interpret")
  assert got.shape == xla.shape == (3, 256) and got.dtype == jnp.bfloat16
  assert _rel(xla, ref) < 1e-2 and _rel(got, ref) < 1e-2
  assert _rel(got, np.asarray(xla, np.float32)) < 4e-3  # same weight, bf16 rounding apart
  # Dispatch on this machine (no Hopper GPU) takes XLA's twin, batched rows too.
  auto = ops.prepared_matmul(x.reshape(1, 3, k), word, scales)
  np.testing.assert_array_equal(np.asarray(auto[0]), np.asarray(xla))
  with pytest.raises(ValueError, match="impl must be one of"):
    ops.prepared_matmul(x, word, scales, impl="cuda")


def test_four_warpgroups_get_registers_the_block_has():
  """Mosaic GPU's pipeline would raise four compute warpgroups to 112 registers each, more
  than a block of 640 threads is launched with (it hung on an H100): the traced kernel asks
  96 (also when a vmap traces its body again, later), two warpgroups keep the pipeline's
  232, and the pipeline's own split is back afterwards."""
  import re

  from jax._src.pallas.mosaic_gpu import pipeline

  from pallas_kernels import _gpu

  def increase(wgs, batched):
    cfg = kernel.Config(block_m=16, compute_wgs=wgs, split_k=2, k_sub=2, delay_release=1)
    n = kernel.WG_ROWS * wgs
    args = (jnp.zeros((16, 512), jnp.bfloat16), jnp.zeros((n, 512), jnp.int4),
            jnp.zeros((8, n), jnp.bfloat16))  # fmt: skip
    f = lambda x, w, s: kernel.forward(x, w, s, config=cfg, lookup="select")  # noqa: E731
    if batched:
      f, args = jax.vmap(jax.jit(f)), [a[None] for a in args]
    text = str(jax.make_jaxpr(f)(*args))  # traced only: no GPU needed
    return [int(v) for v in re.findall(r"set_max_registers_p\[action=increase n=(\d+)\]", text)]

  assert _gpu.four_warpgroups_supported()
  assert increase(4, batched=False) == increase(4, batched=True) == [96]
  assert 4 * 128 * 96 + 128 * 40 <= 640 * 96
  assert increase(2, batched=False) == [232]
  assert pipeline._compute_registers(40, 4) == 112  # restored: what hangs

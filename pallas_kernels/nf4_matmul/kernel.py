"""NF4 dequant-matmul kernels for NVIDIA Hopper, in Pallas Mosaic GPU (``plgpu.kernel``).

The dequantized weight never exists in device memory: tiles of 4-bit codes travel by TMA into
shared memory, become bfloat16 in registers (a 16-entry table lookup, times the block's scale)
and go straight into ``wgmma``.

Forward, y = x @ W^T with W [N, K]: the kernel computes y^T = W x^T, W being the register
operand of wgmma (64 rows of N per compute warpgroup) and x^T the shared-memory operand, so M
(tokens) is wgmma's N dimension and may be as small as 8: one kernel serves decoding (M = 1,
padded to 8) and training (tiles of up to 256 tokens). The output is y^T (XLA transposes it;
nothing at decoding sizes) or, with ``Config.out_rows``, y itself: each tile is written
transposed into shared memory before its TMA store.

Backward, dx = dy @ W: contraction over N, so W's tile is the shared-memory operand in its
natural [N, K] orientation: each compute warpgroup dequantizes its columns of the tile into
shared memory and multiplies dy's tile by it.

The same product through the forward's path (``Config.transposed``): dx = dy @ W as the
forward of dy against W^T's codes (``reference.transposed_codes``, [K, N]) with W's scales
along the tile's columns, so W^T is the register operand and dy the shared-memory one at 256
tokens a tile. The backward's operands both come from shared memory at N = 64 (1.36-1.43x
cuBLAS bf16 on the MLP's shapes at 4096 tokens); this path measured 0.87-1.10x on the 8B
shapes (H100, session 29, plut lookup, experiments/sweep_nf4_train.py), so dispatch takes it
from 2048 tokens.

Operands (made from the stored bitsandbytes layout by ``kernel_operands``):
  w4      int4 [N, K]     bitsandbytes' bytes reinterpreted as JAX int4. bnb puts element 2j in
                          a byte's high nibble, JAX's int4 in the low one; the "prmt" lookup
                          reads the nibbles crosswise so nothing is moved in memory, the "select"
                          lookup (plain jnp ops, runs in interpret mode) needs them swapped, the
                          "word", "lut" and "plut" lookups take the bytes of every 32 columns
                          permuted (``word_codes``).
  scales  bf16 [K/64, N]  absmax after double dequantization, one row per 64-wide k block.

Lookups (lookups.py): "prmt" builds each pair of bfloat16 values with seven byte-permute
instructions over the table held in immediates (inline PTX through ``plgpu.inline_mgpu``),
after a layout cast (a warp shuffle and permutes, twice) has moved the codes from the layout
they load in (8 to a 32-bit register) to wgmma's (2 to a register). "word" looks up the 8 codes
of a loaded register at once (22 instructions for the 8) and needs no cast: its codes are
stored so that each register already holds the columns wgmma's layout gives that thread. "lut"
reads the same registers but loads each byte's pair of levels from a table in shared memory (a
copy per lane, so no bank conflicts): 12 instructions for the 8, and no table constants for
ptxas to copy into registers before every other permute as it does for "word". "plut" pads the
table's rows to 256 bytes so that one byte permute makes each load's address: 8 for the 8.
"select" is a tree of 15 selects. The table entries and scales are rounded to bfloat16 before
their product, so a value can differ from bitsandbytes' bf16(code * absmax) by an ulp of
bfloat16 (with ``Config.blocks_as_columns`` the scale multiplies the float32 product instead);
the fallback path keeps bitsandbytes' exact values.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _gpu, nf4
from pallas_kernels.nf4_matmul.lookups import TABLE_LOOKUPS, levels, lookup_table
from pallas_kernels.nf4_matmul.reference import word_bytes

BLOCK_K = nf4.BLOCKSIZE  # one scale per 64 inputs: the natural k step
WG_ROWS = 64  # rows of wgmma's register operand per warpgroup
SMEM_BYTES = 232_448  # dynamic shared memory one block may have on Hopper (227 KiB)


@dataclasses.dataclass(frozen=True)
class Config:
  block_m: int = 128  # tokens per tile (forward: wgmma N, 8..256; backward: wgmma M, x64)
  block_n: int = 64  # backward: the contraction step over N
  block_k_out: int = 64  # backward: output columns per compute warpgroup (multiple of 64)
  compute_wgs: int = 2
  max_concurrent_steps: int = 4
  # Forward: dequantized tiles go to wgmma from registers (fastest), or through shared memory
  # (what Mosaic GPU's interpreter supports, so the path the CPU tests run).
  a_from_smem: bool = False
  # Forward: the K range split over this many grid cells, partial sums added by XLA. Decoding
  # has few tiles of N (N / 128 cells for one token); splitting K fills the GPU.
  split_k: int = 1
  # Forward: 64-wide k blocks per pipeline step; their wgmmas are issued back to back, so the
  # next block's dequantization overlaps the previous block's matrix product.
  k_sub: int = 1
  # Forward: pipeline steps a step's shared-memory tiles stay held after it (0 or 1). With 1
  # a step's wgmmas are left in flight across the step boundary (waited for one step later),
  # so the next step's dequantization overlaps them too.
  delay_release: int = 0
  # Forward: store the output as y [M, N] (each tile written transposed into shared memory),
  # not as y^T for XLA to transpose: a pass over the output less at training sizes.
  out_rows: bool = False
  # Forward with ``out_rows``: tokens of the output tile stored at a time (0: the whole tile).
  # Two staging buffers of this many rows per warpgroup, each reused once its earlier copy to
  # global memory has read it, instead of a whole tile: shared memory left for more pipeline
  # stages (a 256-token tile's staging is 64 KiB, 64-token chunks' 32 KiB).
  out_chunk: int = 0
  # Forward: the codes are W^T's ([K, N], ``reference.transposed_codes``) and the scales W's
  # ([K/64, N]), so a block's scale runs along the tile's columns: the forward's
  # register-operand path then computes dy @ W, the input gradient (dy [M, N] in x's place).
  transposed: bool = False
  # Forward: the grid walks groups of this many rows of tiles (tokens), all their columns one
  # group after another, instead of one row of tiles at a time: the cells in flight then share
  # fewer distinct operand tiles (L2 reuse). 1: row by row.
  group_m: int = 1
  # Forward, one token: x is spread over COLUMNS rows (``spread_blocks``; block_m = COLUMNS),
  # so each of a step's k blocks multiplies into its own column of a fresh accumulator; the
  # tiles go to the tensor cores unscaled and each column is scaled by its block's scales after
  # the product (a multiply per row and block, not per weight), summed over the columns at the
  # end.
  blocks_as_columns: bool = False


def forward_smem_bytes(
  config: Config, x_itemsize: int = 2, lookup: str = "word", extra_cols: int = 0
) -> int:
  """Shared memory the forward kernel asks for with ``config``, at most (a pipeline of fewer steps
  than ``max_concurrent_steps`` has fewer stages): the pipeline's stages of x, codes and scales,
  the output staging (a tile, or two chunks of ``out_chunk`` tokens; float32 with split K or
  ``blocks_as_columns``), the dequantized-tile staging,
  the table of ``lookup`` "lut" (32 KiB) or "plut" (64 KiB) and 1 KiB for Mosaic GPU's
  barriers (64 bytes measured). 64 tokens, 4 k blocks a step and split K measured 241,728
  bytes with an unused 8 KiB staging tile (no longer allocated), this counts 234,496 without
  it: over ``SMEM_BYTES`` either way, so dispatch takes 2 blocks there. ``extra_cols``: the
  width of ``forward``'s extra operands, which share the output staging's memory."""
  bm, wgs, sub = config.block_m, config.compute_wgs, config.k_sub
  bk, cta_n = BLOCK_K * sub, WG_ROWS * config.compute_wgs
  stage = bm * bk * x_itemsize + cta_n * bk // 2 + sub * cta_n * 2
  out = wgs * WG_ROWS * math.prod(_out_buffers(config))
  out *= 4 if config.split_k > 1 or config.blocks_as_columns else x_itemsize
  if extra_cols:  # x's extra columns and the weight's, each aligned as Mosaic GPU places them
    ex, ew = (_smem_aligned(rows * extra_cols * x_itemsize) for rows in (bm, cta_n))
    out = max(out, ex + ew)
  staged = (wgs * sub if config.a_from_smem else 0) * WG_ROWS * BLOCK_K * x_itemsize
  table = lookup_table(lookup).nbytes if lookup in TABLE_LOOKUPS else 0
  return config.max_concurrent_steps * stage + out + staged + table + 1024


def _smem_aligned(nbytes: int) -> int:
  return -(-nbytes // 1024) * 1024  # Mosaic GPU's alignment of shared-memory allocations


def _out_buffers(config: Config) -> tuple[int, int]:
  """(buffers, tokens each) the forward stages its output in per warpgroup: one whole tile, or
  two chunks (``out_chunk``)."""
  chunk = config.out_chunk
  return (2, chunk) if chunk and chunk < config.block_m else (1, config.block_m)


def kernel_operands(
  codes: jax.Array,
  absmax: jax.Array,
  nested_absmax: jax.Array,
  offset: jax.Array,
  *,
  swap_nibbles: bool,
) -> tuple[jax.Array, jax.Array]:
  """(w4 int4 [N, K], scales bf16 [K/64, N]) from the 2-D layout of ``pallas_kernels.nf4``."""
  scales = nf4.dequantize_absmax(absmax, nested_absmax, offset)  # [N, K/64] float32
  return kernel_codes(codes, swap_nibbles=swap_nibbles), scales.T.astype(jnp.bfloat16)


def kernel_codes(codes: jax.Array, *, swap_nibbles: bool) -> jax.Array:
  """w4 int4 [..., N, K]: the codes uint8 [..., N, K/2] viewed as JAX int4 (nibbles swapped
  for the "select" lookup)."""
  if swap_nibbles:
    codes = (codes << 4) | (codes >> 4)
  *lead, half = codes.shape
  return lax.bitcast_convert_type(codes, jnp.int4).reshape(*lead, 2 * half)


def word_codes(codes: jax.Array) -> jax.Array:
  """w4 int4 [..., N, K] for the "word", "lut" and "plut" lookups: the codes uint8
  [..., N, K/2], each row's 16 bytes of every 32 columns transposed as a 4 x 4 matrix
  (byte 4t + b <- byte 4b + t).

  Why: in WGMMA_LAYOUT_UPCAST_4X thread t (of the 4 sharing a row) loads bytes 4t..4t+3 of
  the 32 columns as one 32-bit register; WGMMA_LAYOUT, same thread -> row assignment, gives it
  columns 8b + 2t and 8b + 2t + 1 of each 8-column core matrix b: bitsandbytes' byte 4b + t.
  After the transpose the register holds exactly those bytes, core matrix b in byte b, and
  bitsandbytes' nibble order is kept (even column in the high nibble; the lookup reads it so).
  A pass over the codes: made once where one weight serves many calls (decoding), per call at
  training sizes; x and the scales keep their order."""
  return kernel_codes(word_bytes(codes), swap_nibbles=False)


COLUMNS = 8  # accumulator columns of ``Config.blocks_as_columns`` (wgmma's narrowest N)


def spread_blocks(x: jax.Array, sub: int) -> jax.Array:
  """x [1, K] -> [COLUMNS, K] for ``Config.blocks_as_columns`` with ``sub`` k blocks a step: row c
  holds x's values in the k blocks b with b % sub == c, zeros elsewhere."""
  if x.shape[0] != 1 or COLUMNS % sub:
    raise ValueError(f"spread_blocks: one row and k blocks a step dividing {COLUMNS}: {x.shape}")
  block = (jnp.arange(x.shape[1]) // BLOCK_K) % sub
  return jnp.where(block[None, :] == jnp.arange(COLUMNS)[:, None], x, 0).astype(x.dtype)


def _column_scales(s_rows, sub: int, interpret: bool):
  """[sub, 64] scales in SMEM (a step's k blocks x a warpgroup's rows) -> f32 [64, COLUMNS] in
  the WGMMA layout, element (r, c) = s[c % sub, r]: each accumulator column's scale. On the GPU
  each thread loads the (at most 4) scales of its own elements."""
  if interpret:
    s = s_rows[...].T.astype(jnp.float32)
    return jnp.concatenate([s] * (COLUMNS // sub), axis=1)
  from jax._src.lib.mlir import ir  # noqa: PLC0415 (MLIR only exists where Mosaic GPU lowers)
  from jax._src.lib.mlir.dialects import arith, memref, vector  # noqa: PLC0415
  from jax.experimental import mosaic as _  # noqa: F401, PLC0415
  from jax.experimental.mosaic import gpu as mgpu  # noqa: PLC0415

  shape = (WG_ROWS, COLUMNS)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=plgpu.Layout.WGMMA),
  )
  def load(ctx, ref):
    del ctx
    f32, index = ir.F32Type.get(), ir.IndexType.get()
    one = ir.VectorType.get((1,), f32)
    layout = plgpu.Layout.WGMMA.to_mgpu()
    regs = np.empty(layout.registers_shape(shape), dtype=object)
    for idx, (row, col) in zip(np.ndindex(regs.shape), layout.thread_idxs(shape), strict=True):
      parts = []
      for e in range(layout.vector_length):  # the register's elements: columns col, col + 1
        c = arith.remui(arith.addi(col, arith.constant(index, e)), arith.constant(index, sub))
        parts.append(vector.broadcast(one, arith.extf(f32, memref.load(ref, [c, row]))))
      regs[idx] = mgpu.utils.vector_concat(parts)
    return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return load(s_rows)


def _dequant_tile(w_smem, s_smem, lookup: str, along: int = 0, table=None):
  """[64, 64] codes in SMEM and their [64] scales in SMEM, one per row (``along`` 0) or per
  column (1) -> bf16 tile in the WGMMA layout (``s_smem`` None: the levels unscaled).
  ``table``: the "lut" or "plut" lookup's (SMEM)."""
  w = levels(plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X), lookup, table)
  if s_smem is None:
    return w
  s = plgpu.load(s_smem, (), layout=plgpu.Layout.WGMMA.reduce(1 - along))
  return w * lax.broadcast_in_dim(s, w.shape, [along])


def _transforms(minor: int, dtype) -> tuple:
  bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
  swizzle = plgpu.find_swizzle(minor * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


# Codes tiles are always tiled 64 wide, so that every [64, 64] sub-tile is whole.
_CODE_TRANSFORMS = _transforms(BLOCK_K, jnp.int4)


def forward(
  x: jax.Array,
  w4: jax.Array,
  scales: jax.Array,
  *,
  config: Config,
  lookup: str = "prmt",
  interpret: Any = None,
  extra: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """y [M, N] = x [M, K] @ dequant(w4, scales)^T; M a multiple of block_m, N of 64 * wgs,
  K of 64 * split_k. With ``config.blocks_as_columns``: x is one token [1, K] (spread over the
  columns here, ``spread_blocks``) and y [1, N]. With ``config.transposed``: w4 holds W^T
  [N, K] of a weight W [K, N] and scales are W's [N/64, K], so y = x @ W (x being dy: the input
  gradient). ``extra`` = (x_extra [M, E], w_extra [N, E]), E a multiple of 16: adds
  x_extra @ w_extra^T (a LoRA's scaled x A and B) by one more wgmma into each tile's
  accumulator, before its k blocks (whole products of untransposed weights only)."""
  bm, wgs, splits, sub = config.block_m, config.compute_wgs, config.split_k, config.k_sub
  columns = config.blocks_as_columns
  if columns and (
    x.shape[0] != 1
    or bm != COLUMNS
    or COLUMNS % sub
    or config.transposed
    or config.out_rows
    or config.delay_release
  ):
    raise ValueError(
      f"nf4 forward kernel: blocks_as_columns takes one token, block_m {COLUMNS}, k_sub "
      f"dividing it, and no transposed, out_rows or delay_release: {x.shape[0]} rows, {config}"
    )
  if columns:
    x = spread_blocks(x, sub)
  m, k = x.shape
  n = w4.shape[0]
  cta_n = WG_ROWS * wgs
  k_part = k // splits
  bk = BLOCK_K * sub
  if m % bm or n % cta_n or k % (bk * splits):
    raise ValueError(
      f"nf4 forward kernel: shape {(m, k, n)} does not tile by {(bm, bk * splits, cta_n)}"
    )
  e = 0 if extra is None else extra[0].shape[1]
  if extra is not None and (
    splits > 1
    or columns
    or config.transposed
    or e % 16
    or extra[0].shape != (m, e)
    or extra[1].shape != (n, e)
    or any(a.dtype != x.dtype for a in extra)
  ):
    raise ValueError(
      f"nf4 forward kernel: extra takes x_extra [{m}, E] and w_extra [{n}, E] in x's dtype, E a "
      f"multiple of 16, for whole untransposed products: {[(a.shape, a.dtype) for a in extra]}, "
      f"{config}"
    )
  if config.out_chunk and (not config.out_rows or bm % config.out_chunk or config.out_chunk % 8):
    raise ValueError(
      f"nf4 forward kernel: out_chunk stores rows of y (out_rows) in chunks of a multiple of 8 "
      f"tokens dividing the tile: {config}"
    )
  if config.out_rows and splits > 1:
    # Mosaic GPU finds no layout for the float32 partial tile stored transposed (it lowers
    # for bf16 only); the interpreter would run it, so refuse it everywhere.
    raise ValueError("nf4 forward kernel: out_rows stores whole products only (split_k 1)")
  if config.a_from_smem and config.delay_release and interpret is None:
    # One staging tile per warpgroup and k block: the next step would overwrite it while the
    # previous step's wgmma may still read it (the interpreter's wgmma is synchronous).
    raise ValueError("nf4 forward kernel: a_from_smem with delay_release races on the GPU")
  if config.delay_release and bm > 16 and interpret is None:
    # Measured on an H100 (experiments/sweep_nf4_train.py): 256-token tiles with wgmmas left
    # in flight return non-finite sums; decoding's 16-token tiles measured exact in every
    # sweep. The backward, whose operands both come from shared memory, ran exact at 256
    # tokens with wgmmas in flight and the same 128-register accumulator, which points at the
    # register operand (PTX: its registers must not change before the wait). The 16-token
    # tiles decoding dispatches were checked for it: 1,920 launches of its configurations
    # bit-identical to the same ones without wgmmas in flight (H100,
    # experiments/log/RESULTS-2026-11.md).
    # Pinning the dequantized tiles into the next step (an optimization barrier after its
    # wait) did not cure the wide tiles (tried).
    raise ValueError("nf4 forward kernel: delay_release is measured correct up to 16 tokens")
  if lookup in TABLE_LOOKUPS and interpret is not None:
    raise ValueError(f"nf4 forward kernel: the {lookup} lookup (inline PTX) runs on the GPU only")
  smem = forward_smem_bytes(config, x.dtype.itemsize, lookup, e)
  if extra is not None and smem > SMEM_BYTES:
    raise ValueError(
      f"nf4 forward kernel: the extra operands ({e} columns) do not fit in shared memory beside "
      f"{config} and the {lookup} lookup; add their product after the kernel's instead"
    )
  if lookup in TABLE_LOOKUPS and smem > SMEM_BYTES:
    raise ValueError(
      f"nf4 forward kernel: the {lookup} lookup's table does not fit in shared memory beside "
      f"{config}; take fewer stages or k blocks a step, or another lookup"
    )
  # Partial sums, and the narrow tiles of blocks_as_columns (8 bf16 are too narrow to swizzle).
  out_dtype = x.dtype if splits == 1 and not columns else jnp.float32
  hold = config.delay_release

  n_tiles, m_tiles, group = n // cta_n, m // bm, config.group_m
  if m_tiles % group:
    raise ValueError(f"nf4 forward kernel: {m_tiles} rows of tiles do not group by {group}")

  lut = lookup in TABLE_LOOKUPS

  def body(
    x_gmem, w_gmem, s_gmem, *refs, o_smem, a_smem=None, lut_smem=None, lut_bar=None,
    extra_bars=None, extra_read=None,
  ):  # fmt: skip
    refs = list(refs)
    lut_gmem = refs.pop(0) if lut else None
    ex_gmem, ew_gmem, o_gmem = refs if extra is not None else (None, None, *refs)
    if extra is not None:  # the extra operands share the output staging's shared memory
      o_smem, (ex_smem, ew_smem) = o_smem
    if group == 1:
      mi, ni = lax.axis_index("m"), lax.axis_index("n")
    else:  # launch order (n fastest) -> groups of ``group`` tile rows, column by column
      lin = lax.axis_index("m") * n_tiles + lax.axis_index("n")
      first, within = lax.div(lin, group * n_tiles) * group, lax.rem(lin, group * n_tiles)
      mi, ni = first + lax.rem(within, group), lax.div(within, group)
    m0 = mi * bm
    n0 = ni * cta_n
    k0 = lax.axis_index("s") * k_part
    wg = lax.axis_index("wg")
    rows = pl.ds(wg * WG_ROWS, WG_ROWS)
    o_part = o_gmem.at[lax.axis_index("s")]
    along = int(config.transposed)

    def compute_context(run_pipeline):
      if lut:  # the table into shared memory once, by the first compute warpgroup's copy

        @pl.when(wg == 0)
        def _():
          plgpu.copy_gmem_to_smem(lut_gmem, lut_smem, lut_bar)

        plgpu.barrier_wait(lut_bar)
      if columns:  # the columns' scaled products, summed per row (every column holds the sum)
        zero = plgpu.layout_cast(jnp.zeros((WG_ROWS, bm), jnp.float32), plgpu.Layout.WGMMA)
        total = jnp.sum(run_pipeline(zero), axis=1)
        store(lax.broadcast_in_dim(total, (WG_ROWS, bm), [0]).astype(o_smem.dtype))
        return

      @functools.partial(pl.run_scoped, acc=plgpu.ACC((WG_ROWS, bm), jnp.float32))
      def _(acc):
        if extra is not None:  # x_extra @ w_extra^T first (waited for with the first k block)

          @pl.when(wg == 0)
          def _():
            plgpu.copy_gmem_to_smem(ex_gmem.at[pl.ds(m0, bm)], ex_smem, extra_bars.at[0])
            plgpu.copy_gmem_to_smem(ew_gmem.at[pl.ds(n0, cta_n)], ew_smem, extra_bars.at[1])

          plgpu.barrier_wait(extra_bars.at[0])
          plgpu.barrier_wait(extra_bars.at[1])
          plgpu.wgmma(acc, ew_smem.at[rows], ex_smem.T)  # [64, E] @ [E, bm]
        run_pipeline(acc)
        plgpu.wgmma_wait(0)  # the last step's wgmmas (left in flight with delay_release)
        if extra is not None:  # every warpgroup is done reading them before the staging
          plgpu.barrier_arrive(extra_read)
          plgpu.barrier_wait(extra_read)
        store(acc[...].astype(o_smem.dtype))  # [64, bm]: a tile of y^T

    def store(tile):
      if config.out_rows:  # in chunks of tokens through two buffers (one for the whole tile)
        buffers, chunk = _out_buffers(config)
        cols = pl.ds(n0 + wg * WG_ROWS, WG_ROWS)
        for c in range(bm // chunk):
          buf = o_smem.at[wg, c % buffers]
          if c >= buffers:  # the copy of chunk c - 2 has read this buffer (the warpgroup waits)
            plgpu.wait_smem_to_gmem(buffers - 1, wait_read_only=True)
          buf.T[...] = tile[:, c * chunk : (c + 1) * chunk]
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(buf, o_part.at[pl.ds(m0 + c * chunk, chunk), cols])
        plgpu.wait_smem_to_gmem(0)
        return
      o_smem.at[wg][...] = tile
      plgpu.commit_smem()
      out = o_part.at[pl.ds(n0 + wg * WG_ROWS, WG_ROWS), pl.ds(m0, bm)]
      plgpu.copy_smem_to_gmem(o_smem.at[wg], out)
      plgpu.wait_smem_to_gmem(0)

    def products(x_smem, w_smem, s_smem, acc):
      for j in range(sub):
        cols = pl.ds(j * BLOCK_K, BLOCK_K)
        scale = None if columns else s_smem.at[wg, cols] if along else s_smem.at[j, rows]
        w = _dequant_tile(w_smem.at[rows, cols], scale, lookup, along, lut_smem)
        if config.a_from_smem:
          a_smem.at[wg, j][...] = w
          plgpu.commit_smem()
          w = a_smem.at[wg, j]
        plgpu.wgmma(acc, w, x_smem.at[:, cols].T)  # [64, 64] @ [64, bm]

    def step(_, x_smem, w_smem, s_smem, acc):
      if columns:  # acc: the running sum of scaled columns (values, not an accumulator)

        def scoped(blocks):
          products(x_smem, w_smem, s_smem, blocks)
          plgpu.wgmma_wait(0)
          return blocks[...]

        prods = pl.run_scoped(scoped, plgpu.ACC((WG_ROWS, bm), jnp.float32))
        return acc + prods * _column_scales(s_smem.at[:, rows], sub, interpret is not None)
      products(x_smem, w_smem, s_smem, acc)
      # Each wgmma is one group: wait for all, or (delay_release) for the previous step's.
      plgpu.wgmma_wait(sub if config.delay_release else 0)
      return acc

    pipeline = plgpu.emit_pipeline_warp_specialized(
      step,
      grid=(k_part // bk,),
      memory_registers=40,
      in_specs=[
        plgpu.BlockSpec(
          (bm, bk), lambda i: (0, i), transforms=_transforms(BLOCK_K, x.dtype), delay_release=hold
        ),
        plgpu.BlockSpec(
          (cta_n, bk), lambda i: (0, i), transforms=_CODE_TRANSFORMS, delay_release=hold
        ),
        plgpu.BlockSpec(
          (wgs, bk) if config.transposed else (sub, cta_n),
          (lambda i: (0, i)) if config.transposed else (lambda i: (i, 0)),
          delay_release=hold,
        ),
      ],
      wg_axis="wg",
      num_compute_wgs=wgs,
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=compute_context,
    )
    with _gpu.compute_registers(wgs):  # the pipeline sets its registers as it is traced
      pipeline(
        x_gmem.at[pl.ds(m0, bm), pl.ds(k0, k_part)],
        w_gmem.at[pl.ds(n0, cta_n), pl.ds(k0, k_part)],
        s_gmem.at[pl.ds(n0 // BLOCK_K, wgs), pl.ds(k0, k_part)]
        if config.transposed
        else s_gmem.at[pl.ds(k0 // BLOCK_K, k_part // BLOCK_K), pl.ds(n0, cta_n)],
      )

  o_type = plgpu.SMEM(
    (wgs, *_out_buffers(config), WG_ROWS) if config.out_rows else (wgs, WG_ROWS, bm),
    out_dtype,
    transforms=_transforms(WG_ROWS if config.out_rows else bm, out_dtype),
  )
  ex_types = (
    [plgpu.SMEM((t, e), x.dtype, transforms=_transforms(e, x.dtype)) for t in (bm, cta_n)]
    if extra is not None
    else []
  )
  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((splits, m, n) if config.out_rows else (splits, n, m), out_dtype),
    scratch_types=dict(
      o_smem=o_type if extra is None else plgpu.RefUnion(o_type, ex_types),
      **(
        dict(
          extra_bars=plgpu.Barrier(num_arrivals=1, num_barriers=2),
          extra_read=plgpu.Barrier(num_arrivals=wgs),
        )
        if extra is not None
        else {}
      ),
      **(
        dict(
          a_smem=plgpu.SMEM(
            (wgs, sub, WG_ROWS, BLOCK_K), x.dtype, transforms=_transforms(BLOCK_K, x.dtype)
          )
        )
        if config.a_from_smem
        else {}
      ),
      **(
        dict(
          lut_smem=plgpu.SMEM(lookup_table(lookup).shape, jnp.uint32),
          lut_bar=plgpu.Barrier(num_arrivals=1),
        )
        if lut
        else {}
      ),
    ),
    grid=(n_tiles, m_tiles, splits),
    grid_names=("n", "m", "s"),
    num_threads=wgs + 1,
    thread_name="wg",
    interpret=interpret,
  )
  out = kernel(x, w4, scales, *([jnp.asarray(lookup_table(lookup))] if lut else []), *(extra or ()))
  if columns:  # every column holds the token's product: one is y
    out = out[..., :1]
  out = (out[0] if splits == 1 else jnp.sum(out, axis=0)).astype(x.dtype)
  return out if config.out_rows else out.T


def backward(
  dy: jax.Array,
  w4: jax.Array,
  scales: jax.Array,
  *,
  config: Config,
  lookup: str = "prmt",
  interpret: Any = None,
) -> jax.Array:
  """dx [M, K] = dy [M, N] @ dequant(w4, scales); M a multiple of block_m (x64), N of block_n,
  K of block_k_out * wgs."""
  if lookup in TABLE_LOOKUPS:
    raise ValueError(f"nf4 backward kernel: the {lookup} lookup is the forward kernel's only")
  m, n = dy.shape
  k = w4.shape[1]
  bm, bn, bko, wgs = config.block_m, config.block_n, config.block_k_out, config.compute_wgs
  cta_k = bko * wgs
  if m % bm or bm % 64 or n % bn or bn % 64 or k % cta_k or bko % BLOCK_K:
    raise ValueError(f"nf4 backward kernel: shape {(m, n, k)} does not tile by {(bm, bn, cta_k)}")
  sub = bko // BLOCK_K  # 64-wide scale blocks per warpgroup

  def body(dy_gmem, w_gmem, s_gmem, o_gmem, wbf_smem, o_smem):
    m0 = lax.axis_index("m") * bm
    k0 = lax.axis_index("k") * cta_k
    wg = lax.axis_index("wg")

    def compute_context(run_pipeline):
      @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, bko), jnp.float32))
      def _(acc):
        run_pipeline(acc)
        o_smem.at[wg][...] = acc[...].astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[pl.ds(m0, bm), pl.ds(k0 + wg * bko, bko)])
        plgpu.wait_smem_to_gmem(0)

    def step(_, dy_smem, w_smem, s_smem, acc):
      mine = wbf_smem.at[wg]
      for j in range(sub):
        for r in range(bn // WG_ROWS):
          rows = pl.ds(r * WG_ROWS, WG_ROWS)
          cols = pl.ds((wg * sub + j) * BLOCK_K, BLOCK_K)
          tile = _dequant_tile(w_smem.at[rows, cols], s_smem.at[wg * sub + j, rows], lookup)
          mine.at[rows, pl.ds(j * BLOCK_K, BLOCK_K)][...] = tile
      plgpu.commit_smem()  # make the stores visible to the tensor cores
      plgpu.wgmma(acc, dy_smem, mine)  # [bm, bn] @ [bn, bko]
      plgpu.wgmma_wait(0)
      return acc

    pipeline = plgpu.emit_pipeline_warp_specialized(
      step,
      grid=(n // bn,),
      memory_registers=40,
      in_specs=[
        plgpu.BlockSpec((bm, bn), lambda i: (0, i), transforms=_transforms(bn, dy.dtype)),
        plgpu.BlockSpec((bn, cta_k), lambda i: (i, 0), transforms=_CODE_TRANSFORMS),
        plgpu.BlockSpec((cta_k // BLOCK_K, bn), lambda i: (0, i)),
      ],
      wg_axis="wg",
      num_compute_wgs=wgs,
      max_concurrent_steps=config.max_concurrent_steps,
      compute_context=compute_context,
    )
    pipeline(
      dy_gmem.at[pl.ds(m0, bm)],
      w_gmem.at[:, pl.ds(k0, cta_k)],
      s_gmem.at[pl.ds(k0 // BLOCK_K, cta_k // BLOCK_K)],
    )

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((m, k), dy.dtype),
    scratch_types=dict(
      wbf_smem=plgpu.SMEM((wgs, bn, bko), dy.dtype, transforms=_transforms(bko, dy.dtype)),
      o_smem=plgpu.SMEM((wgs, bm, bko), dy.dtype, transforms=_transforms(bko, dy.dtype)),
    ),
    grid=(k // cta_k, m // bm),
    grid_names=("k", "m"),
    num_threads=wgs + 1,
    thread_name="wg",
    interpret=interpret,
  )(dy, w4, scales)

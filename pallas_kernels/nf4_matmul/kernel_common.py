"""What the NF4 kernels (kernel.py's forward, kernel_backward.py's backward) share: the tile
constants, the launch ``Config``, the forward's count of shared memory (``forward_smem_bytes``,
which dispatch checks configurations against), the dequantized tile and the shared-memory tiles'
transforms. Imports Mosaic GPU (lookups.py too), so it is loaded with kernel.py, on first use.
"""

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import nf4
from pallas_kernels.nf4_matmul.lookups import TABLE_LOOKUPS, levels, lookup_table

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

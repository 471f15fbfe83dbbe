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

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _gpu
from pallas_kernels.nf4_matmul.kernel_backward import backward  # noqa: F401 (re-exported)
from pallas_kernels.nf4_matmul.kernel_common import (
  _CODE_TRANSFORMS,
  BLOCK_K,
  SMEM_BYTES,
  WG_ROWS,
  Config,
  _dequant_tile,
  _out_buffers,
  _transforms,
  forward_smem_bytes,
)
from pallas_kernels.nf4_matmul.lookups import TABLE_LOOKUPS, lookup_table
from pallas_kernels.nf4_matmul.operands import (  # noqa: F401 (re-exported)
  kernel_codes,
  kernel_operands,
  word_codes,
)

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

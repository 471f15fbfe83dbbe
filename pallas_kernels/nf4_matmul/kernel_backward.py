"""The NF4 backward kernel, dx = dy @ W, in Pallas Mosaic GPU (``plgpu.kernel``); kernel.py's
module docstring describes it, and kernel.py re-exports ``backward``.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.nf4_matmul.kernel_common import (
  _CODE_TRANSFORMS,
  BLOCK_K,
  WG_ROWS,
  Config,
  _dequant_tile,
  _transforms,
)
from pallas_kernels.nf4_matmul.lookups import TABLE_LOOKUPS


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

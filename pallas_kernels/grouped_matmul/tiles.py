"""The grouped matmul as tiles of one group each, by XLA's batched matmul: every group's rows
padded to a multiple of ``tile`` rows, so each tile of the padded rows belongs to one group and
multiplies that group's weight; a dense batched product ([tiles, tile, K] x [tiles, K, N]) that
cuBLAS runs near its matmul rate, where XLA's own ragged_dot lowers to a slow loop on GPUs
(experiments/bench_moe.py: 4-5 TFLOP/s on an H200 at Qwen3-30B-A3B's expert shapes).

The tiles' count is bounded statically, (M + G * (tile - 1)) / tile rounded up, so the shape
is fixed under jit whatever the routing; padding rows are zeros and their outputs dropped.
Each tile gathers its group's weight: tiles x K x N values read, once per call.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.reference import row_groups

TILE = 64


def grouped_matmul_tiles(
  x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int = TILE
) -> jax.Array:
  """x [M, K] (rows sorted by group) times w [G, K, N] -> [M, N] in x's dtype, float32
  accumulation; rows past sum(group_sizes) are zero, as ``jax.lax.ragged_dot`` gives them.
  Differentiable by a VJP of the same tiled products (dx: dy times each group's w
  transposed; dw: each tile's x^T dy summed into its group), so no gathered weight is kept
  for the backward pass."""
  return _tiled(x, w, group_sizes.astype(jnp.int32), tile)


def _layout(group_sizes: jax.Array, m: int, g: int, tile: int):
  """(tiles, destination row of each source row [M] (past the padded rows for rows past the
  groups), each row's validity [M], each tile's group [tiles] (G past the groups))."""
  tiles = -(-(m + g * (tile - 1)) // tile)
  rows = tiles * tile
  padded = -(-group_sizes // tile) * tile  # [G] each group's rows, padded
  padded_end = jnp.cumsum(padded)
  start = jnp.cumsum(group_sizes) - group_sizes
  group = row_groups(group_sizes, m)  # [M]; G past the groups
  valid = group < g
  at = jnp.minimum(group, g - 1)
  dest = jnp.where(valid, padded_end[at] - padded[at] + jnp.arange(m) - start[at], rows)
  tile_group = jnp.searchsorted(padded_end, jnp.arange(tiles) * tile, side="right")
  return tiles, dest, valid, tile_group.astype(jnp.int32)


def _to_tiles(x, dest, tiles, tile):
  rows = jnp.zeros((tiles * tile, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
  return rows.reshape(tiles, tile, x.shape[1])


def _from_tiles(yp, dest, valid, dtype):
  y = yp.reshape(-1, yp.shape[-1]).at[dest].get(mode="fill", fill_value=0)
  return jnp.where(valid[:, None], y, 0).astype(dtype)


def _product(x, w, group_sizes, tile):
  m, g = x.shape[0], w.shape[0]
  tiles, dest, valid, tile_group = _layout(group_sizes, m, g, tile)
  w = jax.lax.optimization_barrier(w)  # gathered as it is, not recomputed per tile
  wt = w[jnp.minimum(tile_group, g - 1)].astype(x.dtype)  # [tiles, K, N]
  xp = _to_tiles(x, dest, tiles, tile)
  yp = jnp.einsum("tik,tkn->tin", xp, wt, preferred_element_type=jnp.float32)
  return _from_tiles(yp, dest, valid, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x, w, group_sizes, tile):
  return _product(x, w, group_sizes, tile)


def _tiled_fwd(x, w, group_sizes, tile):
  return _product(x, w, group_sizes, tile), (x, w, group_sizes)


def _tiled_bwd(tile, res, dy):
  x, w, group_sizes = res
  m, g = x.shape[0], w.shape[0]
  dx = _product(dy.astype(x.dtype), jnp.swapaxes(w, 1, 2), group_sizes, tile)
  tiles, dest, _, tile_group = _layout(group_sizes, m, g, tile)
  xp, dyp = _to_tiles(x, dest, tiles, tile), _to_tiles(dy.astype(x.dtype), dest, tiles, tile)
  per_tile = jnp.einsum("tik,tin->tkn", xp, dyp, preferred_element_type=jnp.float32)
  dw = jax.ops.segment_sum(per_tile, tile_group, num_segments=g)  # tiles past: dropped
  return dx, dw.astype(w.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)

"""The grouped matmul written plainly: each row's group found from the group sizes, the
product taken against that group's weight gathered per row. Memory grows with rows x weight
size: a reference for tests, not a path for real shapes."""

import jax
import jax.numpy as jnp


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
  """The group of each of ``rows`` rows [rows] int32, rows sorted by group with
  ``group_sizes`` [G] rows each; rows past their sum get G (no group)."""
  ends = jnp.cumsum(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(rows), side="right").astype(jnp.int32)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """x [M, K] (rows sorted by group) times w [G, K, N] -> [M, N] in x's dtype, float32
  accumulation; rows past sum(group_sizes) are zero, as ``jax.lax.ragged_dot`` gives them."""
  g = w.shape[0]
  groups = row_groups(group_sizes, x.shape[0])
  valid = groups < g
  per_row = w[jnp.minimum(groups, g - 1)]  # [M, K, N]
  y = jnp.einsum("mk,mkn->mn", x, per_row, preferred_element_type=jnp.float32)
  return jnp.where(valid[:, None], y, 0).astype(x.dtype)

"""y = x @ w[group of each row] for rows sorted by group (a mixture of experts' tokens sorted
by expert), differentiable in x and w.

``impl``: "ragged_dot" (the default: ``jax.lax.ragged_dot``, XLA's grouped product), "tiles"
(tiles.py: groups padded to tiles of one group, XLA's batched matmul; 5-25x faster than
ragged_dot on an H200, experiments/bench_moe.py) or "reference" (reference.py, the pure-jnp
product per row). The caller picks; nothing here looks at the device.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import reference, tiles

IMPLS = ("ragged_dot", "tiles", "reference")


def grouped_matmul(
  x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "ragged_dot"
) -> jax.Array:
  """x [M, K] times w [G, K, N] with ``group_sizes`` [G] (int32, summing to at most M; rows
  past the sum come out zero) -> [M, N] in x's dtype, accumulated in float32."""
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl must be one of {', '.join(IMPLS)}, got {impl!r}.")
  if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or group_sizes.shape != w.shape[:1]:
    raise ValueError(
      "grouped_matmul: expected x [M, K], w [G, K, N] and group_sizes [G]; got "
      f"{x.shape}, {w.shape} and {group_sizes.shape}."
    )
  group_sizes = group_sizes.astype(jnp.int32)
  if impl == "reference":
    return reference.grouped_matmul_reference(x, w, group_sizes)
  if impl == "tiles":
    return tiles.grouped_matmul_tiles(x, w, group_sizes)
  y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
  return y.astype(x.dtype)

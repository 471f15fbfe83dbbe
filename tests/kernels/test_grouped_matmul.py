"""The grouped product of a mixture of experts (pallas_kernels.grouped_matmul): XLA's
ragged_dot and the tiled batched product against the pure-jnp reference on ragged group
sizes, empty groups and rows past the groups included, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference, row_groups


@pytest.mark.parametrize("impl", ["ragged_dot", "tiles"])
@pytest.mark.parametrize(
  "sizes",
  [(3, 0, 5, 1), (0, 0, 9, 0), (1, 1, 1, 1), (2, 3, 0, 0)],
  ids=["ragged", "one-group", "ones", "rows-past-the-groups"],
)
def test_each_impl_equals_the_reference_with_its_gradients(sizes, impl):
  rng = np.random.default_rng(sum(sizes))
  m, k, n = 9, 8, 5
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  y = grouped_matmul(x, w, gs, impl=impl)
  np.testing.assert_allclose(y, grouped_matmul(x, w, gs, impl="reference"), rtol=1e-6, atol=1e-6)
  # Each row against its own group's weight, written out.
  groups = np.repeat(np.arange(len(sizes)), sizes)
  want = np.zeros((m, n), np.float32)
  for r, g in enumerate(groups):
    want[r] = np.asarray(x[r]) @ np.asarray(w[g])
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  probe = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(impl):
    return lambda x, w: jnp.sum(jnp.sin(grouped_matmul(x, w, gs, impl=impl)) * probe)

  got = jax.grad(loss(impl), argnums=(0, 1))(x, w)
  ref = jax.grad(loss("reference"), argnums=(0, 1))(x, w)
  for a, b in zip(got, ref, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  if sum(sizes) < m:  # rows past the groups get no product and no gradient
    assert not np.any(np.asarray(y[sum(sizes) :]))
    assert not np.any(np.asarray(got[0][sum(sizes) :]))


def test_row_groups_and_shape_errors():
  np.testing.assert_array_equal(row_groups(jnp.asarray([2, 0, 1]), 4), [0, 0, 2, 3])
  x, w = jnp.zeros((4, 8)), jnp.zeros((3, 8, 2))
  with pytest.raises(ValueError, match="impl must be one of"):
    grouped_matmul(x, w, jnp.asarray([1, 1, 1]), impl="mosaic")
  with pytest.raises(ValueError, match=r"expected x \[M, K\]"):
    grouped_matmul(x, w, jnp.asarray([1, 1]))
  assert grouped_matmul_reference(x, w, jnp.asarray([1, 1, 1])).shape == (4, 2)


def test_tiles_smaller_than_the_groups_split_them_exactly():
  """Groups of several tiles, a partial last tile each, an empty group between, rows past
  the groups: the tiled product and its gradients equal the reference."""
  from pallas_kernels.grouped_matmul.tiles import grouped_matmul_tiles

  rng = np.random.default_rng(7)
  sizes = jnp.asarray([9, 0, 4, 6, 1], jnp.int32)  # 20 rows in tiles of 4, 3 rows past them
  x = jnp.asarray(rng.standard_normal((23, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((5, 8, 3)), jnp.float32)
  probe = jnp.asarray(rng.standard_normal((23, 3)), jnp.float32)

  def loss(f):
    return lambda x, w: jnp.sum(jnp.sin(f(x, w)) * probe)

  tiled = lambda x, w: grouped_matmul_tiles(x, w, sizes, tile=4)  # noqa: E731
  ref = lambda x, w: grouped_matmul_reference(x, w, sizes)  # noqa: E731
  np.testing.assert_allclose(tiled(x, w), ref(x, w), rtol=1e-6, atol=1e-6)
  for a, b in zip(
    jax.grad(loss(tiled), (0, 1))(x, w), jax.grad(loss(ref), (0, 1))(x, w), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

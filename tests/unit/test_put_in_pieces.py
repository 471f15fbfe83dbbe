"""Large tensors go to the device in row pieces (bounded host staging), unchanged."""

import jax
import numpy as np

from jaxtune.hf import device_put


def test_a_large_tensor_arrives_whole_in_bounded_pieces(monkeypatch):
  sizes = []
  real = jax.device_put

  def spy(x, *args, **kwargs):
    sizes.append(x.nbytes)
    return real(x, *args, **kwargs)

  monkeypatch.setattr(device_put.jax, "device_put", spy)
  device = jax.devices()[0]
  rng = np.random.default_rng(0)
  big = rng.standard_normal((1000, 33)).astype(np.float32)  # 132,000 bytes, 132 per row
  got = device_put.put_in_pieces(big, device, piece_bytes=10_000)
  np.testing.assert_array_equal(np.asarray(got), big)
  assert got.devices() == {device}
  assert len(sizes) == 14 and max(sizes) <= 10_000  # 75 rows (9,900 bytes) a piece
  sizes.clear()
  small = big[:150]  # 19,800 bytes: up to two pieces' worth goes whole
  np.testing.assert_array_equal(np.asarray(device_put.put_in_pieces(small, device, 10_000)), small)
  assert sizes == [small.nbytes]  # one copy when it fits a piece

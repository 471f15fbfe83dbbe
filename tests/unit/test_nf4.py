"""NF4 against bitsandbytes 0.50.2 itself (its CPU backend), byte for byte."""

import bitsandbytes.functional as bnbf
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_kernels import nf4
from pallas_kernels.nf4_maps import DYNAMIC_MAP, NF4_CODE

# Several shapes: a Llama-like matrix, one whose size is not a multiple of 64, one with an odd
# number of elements, and sizes whose absmax count ends in a partial group of 256.
SHAPES = [(128, 256), (96, 200), (37, 51), (1000, 64 * 5 + 7), (512, 4 * 64 * 256 // 512 + 64)]


def _bnb(w: np.ndarray):
  packed, state = bnbf.quantize_4bit(
    torch.from_numpy(w), blocksize=64, compress_statistics=True, quant_type="nf4"
  )
  return packed, state


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_bitsandbytes(shape):
  rng = np.random.default_rng(sum(shape))
  w = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0)).astype(np.float32)
  packed, state = _bnb(w)

  codes, absmax = nf4.quantize_4bit_blocks(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(codes), packed.numpy().reshape(-1))
  # bnb keeps the float32 absmax only inside quant_state before compressing it; recover it
  # from its own first stage (the op the public function calls).
  _, bnb_absmax = torch.ops.bitsandbytes.quantize_4bit.default(
    torch.from_numpy(w), 64, "nf4", torch.uint8
  )
  np.testing.assert_array_equal(np.asarray(absmax), bnb_absmax.numpy())

  # Our offset is the correctly rounded mean; torch's float32 mean may differ in the last ulp.
  ours_offset = np.float32(nf4.mean_offset(absmax))
  bnb_offset = np.float32(state.offset.item())
  assert abs(int(ours_offset.view(np.int32)) - int(bnb_offset.view(np.int32))) <= 2

  # Given the same offset, the nested stage is byte-identical, including the partial group.
  absmax_q, nested, _ = nf4.double_quantize(absmax, offset=bnb_offset)
  np.testing.assert_array_equal(np.asarray(absmax_q), state.absmax.numpy())
  np.testing.assert_array_equal(np.asarray(nested), state.state2.absmax.numpy())
  np.testing.assert_array_equal(DYNAMIC_MAP, state.state2.code.numpy())
  np.testing.assert_array_equal(NF4_CODE, state.code.numpy())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_bitsandbytes(shape, dtype):
  rng = np.random.default_rng(7 + sum(shape))
  w = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
  packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
  expected = bnbf.dequantize_4bit(packed, state).float().numpy()

  q = nf4.NF4Quantized(
    jnp.asarray(packed.numpy().reshape(-1)),
    jnp.asarray(state.absmax.numpy()),
    jnp.asarray(state.state2.absmax.numpy()),
    jnp.asarray(state.offset.numpy()),
  )
  jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
  got = np.asarray(nf4.dequantize(q, shape, jdtype).astype(jnp.float32))
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("shape", [(128, 256), (64, 64 * 9), (320, 448)])
def test_full_roundtrip_matches_bitsandbytes(shape):
  """Quantize and dequantize end to end with our own offset (see nf4.py on the mean)."""
  rng = np.random.default_rng(11 + sum(shape))
  w = rng.standard_normal(shape).astype(np.float32)
  packed, state = _bnb(w)
  q = nf4.quantize(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(q.codes), packed.numpy().reshape(-1))
  np.testing.assert_array_equal(np.asarray(q.absmax), state.absmax.numpy())
  # Only the offset's last ulp may differ, so the weights agree to float32 precision.
  np.testing.assert_allclose(
    np.asarray(nf4.dequantize(q, shape)),
    bnbf.dequantize_4bit(packed, state).numpy(),
    rtol=1e-6,
    atol=1e-7,
  )


def test_linear_layout_is_bnb_layout_reshaped():
  rng = np.random.default_rng(3)
  w = rng.standard_normal((192, 320)).astype(np.float32)
  flat = nf4.quantize(jnp.asarray(w))
  two_d = nf4.quantize_linear(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(two_d.codes).reshape(-1), np.asarray(flat.codes))
  np.testing.assert_array_equal(np.asarray(two_d.absmax).reshape(-1), np.asarray(flat.absmax))
  np.testing.assert_array_equal(
    np.asarray(nf4.dequantize_linear(*two_d, jnp.float32)),
    np.asarray(nf4.dequantize(flat, w.shape)),
  )
  # And the error of NF4 is what 4 bits allow: well under 10% of the block scale.
  err = np.abs(np.asarray(nf4.dequantize(flat, w.shape)) - w).max()
  assert 0 < err < 0.2 * np.abs(w).max()


def test_dynamic_map_table_is_the_midpoint_rule():
  """The 8-bit step's table gives every grid point the level whose float32 midpoints bracket
  it, exactly as comparing with the midpoints on the device does."""
  grid = jnp.arange(65536, dtype=jnp.int32).astype(jnp.float32)
  value = -1.0 + (2.0 * grid) / 65535.0
  direct = jnp.sum(value[:, None] > jnp.asarray(nf4._DYNAMIC_MIDPOINTS), axis=1)
  np.testing.assert_array_equal(nf4._dynamic_lut(), np.asarray(direct))


def test_linear_rejects_inputs_not_multiple_of_64():
  with pytest.raises(ValueError, match="multiple of 64"):
    nf4.quantize_linear(jnp.zeros((8, 100)))


def test_experts_are_quantized_one_by_one_as_bitsandbytes_does():
  """A mixture of experts' [E, out, in]: each expert's codes and absmax as bitsandbytes
  quantizes that expert alone (its own double-quantization offset, not the stack's), and
  dequantized each as bitsandbytes does."""
  rng = np.random.default_rng(21)
  w = (rng.standard_normal((3, 64, 128)) * np.array([0.5, 1.0, 4.0])[:, None, None]).astype(
    np.float32
  )
  q = nf4.quantize_experts(jnp.asarray(w))
  assert q.codes.shape == (3, 64, 64) and q.offset.shape == (3,)
  back = np.asarray(nf4.dequantize_experts(*q, jnp.float32))
  for e in range(3):
    packed, state = _bnb(w[e])
    np.testing.assert_array_equal(np.asarray(q.codes[e]).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(q.absmax[e]).reshape(-1), state.absmax.numpy())
    want = bnbf.dequantize_4bit(packed, state).numpy()
    np.testing.assert_allclose(back[e], want, rtol=1e-6, atol=1e-7)
  assert len({float(o) for o in np.asarray(q.offset)}) == 3  # one offset per expert

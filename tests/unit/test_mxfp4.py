"""MXFP4 (pallas_kernels.mxfp4), gpt-oss's expert storage: dequantization equals
transformers' own (convert_moe_packed_tensors) bit for bit, quantization gives back what it
dequantized value for value, and mismatched blocks and scales are refused."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_kernels import mxfp4


def _random(seed, shape=(3, 5, 4)):
  rng = np.random.default_rng(seed)
  blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
  scales = rng.integers(127 - 20, 127 + 8, shape, dtype=np.uint8)
  return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_bit_for_bit(dtype):
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  blocks, scales = _random(0)
  want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
  jdtype = jnp.float32 if dtype == torch.float32 else jnp.bfloat16
  got = mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales), jdtype)  # [E, N, K]
  assert got.shape == (3, 5, 4 * 32)
  np.testing.assert_array_equal(
    np.asarray(got.astype(jnp.float32)).transpose(0, 2, 1), want.float().numpy()
  )


@pytest.mark.slow
def test_quantize_gives_back_what_dequantize_made():
  blocks, scales = _random(1)
  values = mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales))
  b2, s2 = mxfp4.quantize(values)
  np.testing.assert_array_equal(mxfp4.dequantize(b2, s2), values)
  # Off the grid: each value the nearest E2M1 value of its block's scale.
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((4, 64)) * 3, jnp.float32)
  b3, s3 = mxfp4.quantize(w)
  back = np.asarray(mxfp4.dequantize(b3, s3)).reshape(4, 2, 32)
  scale = np.ldexp(1.0, np.asarray(s3, np.int32) - 127)[..., None]
  grid = np.concatenate([-mxfp4.CODE[:8], mxfp4.CODE[:8]]) * scale[..., None]  # [4, 2, 1, 16]
  nearest = np.abs(np.asarray(w).reshape(4, 2, 32)[..., None] - grid).min(-1)
  np.testing.assert_allclose(np.abs(back - np.asarray(w).reshape(4, 2, 32)), nearest, atol=1e-6)
  assert np.abs(back).max(axis=-1).max() <= 6 * scale.max()


def test_blocks_and_scales_that_disagree_are_refused():
  blocks, scales = _random(3)
  with pytest.raises(ValueError, match=r"disagree in shape"):
    mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales[:, :4]))
  assert mxfp4.check_shapes((3, 5, 4, 8), (3, 5, 4)).startswith("blocks must be")
  with pytest.raises(ValueError, match="multiple of 32"):
    mxfp4.quantize(jnp.zeros((2, 48)))

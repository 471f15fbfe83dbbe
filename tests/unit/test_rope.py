"""YaRN's frequencies and attention factor (jaxtune.models.rope.yarn_frequencies) against
transformers' _compute_yarn_parameters: gpt-oss's defaults (truncate off), a Qwen-style YaRN
(truncate on) and DeepSeek's mscale pair."""

import numpy as np
import pytest

from jaxtune.models import rope


@pytest.mark.parametrize(
  "params",
  [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},
    {"factor": 4.0, "original_max_position_embeddings": 32768},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096, "beta_fast": 24.0},
  ],
  ids=["gpt-oss", "qwen-yarn", "mscales"],
)  # fmt: skip
def test_yarn_matches_transformers(params):
  from transformers import LlamaConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  theta, head_dim = 150000.0, 64
  cfg = LlamaConfig(
    hidden_size=256, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=131072,
    rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params},
  )  # fmt: skip
  want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
  got_inv, got_factor = rope.yarn_frequencies(
    theta, head_dim, params["factor"], params["original_max_position_embeddings"],
    beta_fast=params.get("beta_fast", 32.0), beta_slow=params.get("beta_slow", 1.0),
    truncate=params.get("truncate", True), mscale=params.get("mscale"),
    mscale_all_dim=params.get("mscale_all_dim"),
  )  # fmt: skip
  # Within an ulp: torch's vectorised float32 pow and numpy's differ in the last bit for a
  # few exponents (either way, float32 or float64 then rounded).
  np.testing.assert_allclose(got_inv, want_inv.numpy(), rtol=2.5e-7, atol=0)
  assert got_factor == pytest.approx(want_factor, rel=1e-12)
  plain = rope.yarn_frequencies(theta, head_dim, 1.0, 4096)[0]
  assert not np.array_equal(got_inv, plain)  # the factor changed the low frequencies

"""LayerPattern: kinds of layers, their stacks, periods and slots (models/pattern.py)."""

import pytest

from jaxtune.models.pattern import LayerPattern, qwen3_moe_kinds


def test_one_kind_is_indexed_as_the_checkpoint():
  p = LayerPattern(("layer",) * 5)
  assert not p.mixed and p.period == ("layer",) and p.num_periods == 5
  assert [p.slot(i) for i in range(5)] == [(None, i) for i in range(5)]
  assert p.layer(None, 3) == 3


def test_a_repeating_period_gives_each_kind_its_own_stack():
  kinds = ("linear", "linear", "linear", "full") * 3  # Qwen3.5's three linear, one full
  p = LayerPattern(kinds)
  assert p.mixed and p.names == ("linear", "full")
  assert p.period == ("linear", "linear", "linear", "full") and p.num_periods == 3
  assert p.ids("full") == (3, 7, 11) and p.count("linear") == 9
  assert p.slot(7) == ("full", 1) and p.slot(8) == ("linear", 6)
  assert [p.layer(*p.slot(i)) for i in range(12)] == list(range(12))
  assert p.in_period() == (("linear", 0), ("linear", 1), ("linear", 2), ("full", 0))


def test_a_stack_without_a_shorter_period_is_its_own():
  p = LayerPattern(("dense", "sparse", "sparse", "dense", "sparse"))
  assert p.period == p.kinds and p.num_periods == 1
  assert p.slot(3) == ("dense", 1) and p.slot(4) == ("sparse", 2)
  with pytest.raises(IndexError):
    p.slot(5)


@pytest.mark.slow
def test_qwen3_moe_kinds_follow_transformers_rule():
  import transformers

  cfg = transformers.Qwen3MoeConfig(
    num_hidden_layers=6, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3]
  )
  model = transformers.Qwen3MoeModel._from_config(
    cfg.__class__(**{**cfg.to_dict(), "hidden_size": 16, "intermediate_size": 8,
                     "moe_intermediate_size": 8, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 32})
  )  # fmt: skip
  want = tuple(
    "sparse" if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" else "dense"
    for layer in model.layers
  )
  assert want == ("dense", "sparse", "dense", "dense", "dense", "sparse")
  assert qwen3_moe_kinds(6, 4, (3,), 2) == want
  assert qwen3_moe_kinds(4, 0, (), 1) == ("dense",) * 4

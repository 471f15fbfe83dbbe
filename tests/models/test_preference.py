"""Preference tuning (--method dpo, ipo, orpo): the objective and its LoRA gradients against
transformers + peft, pairs in the data (encoded, packed whole, fitted to seq-len), learning on
CPU. Mesh equality is in test_rl.py, beside GRPO's; bad input (missing responses, no room,
the wrong data for the method, --beta, --label-smoothing) in test_catalogue.py."""

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
  assert_lora_grads_match_peft,
  background_run,
  build_hf_llama,
  copy_peft_lora_into,
  peft_with_random_adapters,
  run_cli,
)
from flax import nnx

import jaxtune
from jaxtune.data import formats
from jaxtune.data import rows as data
from jaxtune.data import tokenize as data_tokenize
from jaxtune.data.settings import DataSettings
from jaxtune.errors import DataError
from jaxtune.parallel import runtime
from jaxtune.run import default_model
from jaxtune.training import preference

IGNORE = data.IGNORE


def _pairs(n: int, seed: int = 0):
  """n random pairs: (prompt + chosen ids, labels), (prompt + rejected ids, labels), labels
  unshifted (IGNORE on the prompt), responses of different lengths."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    prompt = list(rng.integers(1, 256, rng.integers(2, 7)))
    sides = []
    for _ in range(2):
      response = list(rng.integers(1, 256, rng.integers(2, 9)))
      sides.append((prompt + response, [IGNORE] * len(prompt) + response))
    out.append(tuple(sides))
  return out


def _pair_dataset(pairs, seq_len: int, pack: bool = True) -> data.Dataset:
  """The Dataset load() builds for these pairs: examples 2p, 2p + 1 in one flat layout."""
  examples = [side for pair in pairs for side in pair]
  lengths = np.array([len(ids) for ids, _ in examples])
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  tokens = np.concatenate([ids for ids, _ in examples] + [[0]]).astype(np.int32)
  labels = np.concatenate([lab for _, lab in examples] + [[IGNORE]]).astype(np.int32)
  return data.Dataset(tokens, labels, starts, lengths - 1, seq_len, pack, pairs=True)


# ---------------------------------------------------------------- the objective vs transformers


def _torch_log_probs(model, ids, labels) -> torch.Tensor:
  """Sum of log p(response token) of one sequence, as TRL computes it from the logits."""
  logits = model(torch.tensor([ids])).logits[0, :-1].float()
  logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
  mask = torch.tensor(labels[1:]) != IGNORE
  return (logp * mask).sum(), mask.sum()


def _torch_loss(method, beta, smoothing, lam, c, r, c0, r0, n_c, n_r):
  """One pair's loss from the formulas TRL 1.16 uses (DPO's sigmoid with cDPO smoothing,
  IPO's length-normalised square, ORPO's odds ratio) and ORPO's chosen NLL."""
  f = torch.nn.functional
  if method == "dpo":
    d = (c - c0) - (r - r0)
    return -(1 - smoothing) * f.logsigmoid(beta * d) - smoothing * f.logsigmoid(-beta * d)
  if method == "ipo":
    d = (c - c0) / n_c - (r - r0) / n_r
    return (d - 1 / (2 * beta)) ** 2
  a, b = c / n_c, r / n_r
  log_odds = (a - b) - (torch.log1p(-torch.exp(a)) - torch.log1p(-torch.exp(b)))
  return -a - lam * f.logsigmoid(log_odds)


@pytest.fixture(scope="module")
def parity_setup(tmp_path_factory):
  """A tiny float32 Llama with random PEFT adapters (so policy != reference), and 5 pairs
  packed into rows of 40 tokens (some rows hold two pairs)."""
  path = tmp_path_factory.mktemp("pref") / "llama"
  hf = build_hf_llama(7, num_hidden_layers=2)
  hf.save_pretrained(path)
  peft_model = peft_with_random_adapters(hf, rank=4, alpha=8, seed=1)
  model = jaxtune.apply_lora(
    jaxtune.from_pretrained(path, quantization=None, dtype="float32"), rank=4, alpha=8
  )
  copy_peft_lora_into(model, peft_model)
  pairs = _pairs(5, seed=2)
  dataset = _pair_dataset(pairs, seq_len=40)
  assert dataset.max_segments == 4 and len(dataset) < 5  # pairs share rows
  return model, peft_model, pairs, dataset


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "ipo", "orpo"])
def test_objective_and_lora_gradients_match_transformers(parity_setup, method):
  model, peft_model, pairs, dataset = parity_setup
  beta, lam, smoothing = 0.5, 0.3, 0.0
  peft_model.zero_grad()
  losses, reference = [], []
  for chosen, rejected in pairs:
    c, n_c = _torch_log_probs(peft_model, *chosen)
    r, n_r = _torch_log_probs(peft_model, *rejected)
    with torch.no_grad(), peft_model.disable_adapter():
      c0, _ = _torch_log_probs(peft_model, *chosen)
      r0, _ = _torch_log_probs(peft_model, *rejected)
    reference.append((float(c0), float(r0)))
    losses.append(_torch_loss(method, beta, smoothing, lam, c, r, c0, r0, n_c, n_r))
  torch_loss = torch.stack(losses).mean()
  torch_loss.backward()

  objective = preference.Preference(method, beta, smoothing, lam, dataset.max_segments)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  batch = {k: jnp.asarray(v) for k, v in dataset.rows(np.arange(len(dataset))).items()}

  def mean_loss(lo):
    s, n, aux = objective(graphdef, lo, frozen, batch, None, runtime.DEFAULT)
    return s / n, (n, aux)

  (loss, (n, aux)), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(lora)
  assert int(n) == len(pairs)
  np.testing.assert_allclose(float(loss), torch_loss.item(), rtol=1e-5)
  assert assert_lora_grads_match_peft(model, grads, peft_model) == 14
  # The reference is the model with its adapters zeroed: transformers with them disabled.
  zero = jax.tree.map(jnp.zeros_like, lora)
  c0, r0, _, _, valid = objective.pair_log_probs(
    graphdef, zero, frozen, batch, None, runtime.DEFAULT
  )
  got = np.stack([np.asarray(c0)[np.asarray(valid)], np.asarray(r0)[np.asarray(valid)]], 1)
  order = _pair_order(dataset)
  np.testing.assert_allclose(got, np.array(reference)[order], rtol=1e-5)
  assert float(aux["tokens"]) == sum(
    sum(t != IGNORE for t in lab[1:]) for pair in pairs for _, lab in pair
  )


def test_label_smoothing_is_conservative_dpo():
  """--label-smoothing e: -(1 - e) log s(beta d) - e log s(-beta d), e = 0 the sigmoid loss."""
  rng = np.random.default_rng(0)
  c, r, c0, r0 = (rng.normal(-20, 5, (3, 2)).astype(np.float32) for _ in range(4))
  n = np.full((3, 2), 7.0, np.float32)
  for e in (0.0, 0.25):
    got = preference.Preference("dpo", 0.3, e).pair_losses(c, r, c0, r0, n, n, n > 0)[0]
    want = _torch_loss("dpo", 0.3, e, 0.0, *map(torch.from_numpy, (c, r, c0, r0, n, n)))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)


def _pair_order(dataset: data.Dataset) -> np.ndarray:
  """The pairs in the order a batch of every row holds them (row by row, slot by slot)."""
  members = [dataset._members[dataset._ptr[r] : dataset._ptr[r + 1]] for r in range(len(dataset))]
  return np.array([e // 2 for m in members for e in m[0::2]])


# ---------------------------------------------------------------- pairs in the data


@pytest.fixture(scope="module")
def tok():
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(default_model.ensure_default_checkpoint())


def test_preference_rows_encode_as_two_examples(tok):
  enc = formats.Encoder("preference", tok)
  prompt = [{"role": "user", "content": "What is 2 plus 2?"}]
  chosen = [{"role": "assistant", "content": "It is 4."}]
  rejected = [{"role": "assistant", "content": "It is 5."}]
  explicit = enc.examples({"prompt": prompt, "chosen": chosen, "rejected": rejected}, 0)
  implicit = enc.examples({"chosen": prompt + chosen, "rejected": prompt + rejected}, 0)
  assert explicit == implicit  # TRL's implicit prompt: the shared first messages
  pc = formats.Encoder("prompt_completion", tok)
  assert explicit[0] == pc({"prompt": prompt, "completion": chosen}, 0)
  assert explicit[1] == pc({"prompt": prompt, "completion": rejected}, 0)
  # Strings: the prompt untrained, each response and EOS trained.
  (ids, labels), _ = enc.examples({"prompt": "Q: hi\nA:", "chosen": " yes", "rejected": " no"}, 0)
  trained = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
  assert trained == tok(" yes", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
  with pytest.raises(DataError, match="row 4 has no 'rejected' response"):
    enc.examples({"prompt": "x", "chosen": "a", "rejected": ""}, 3)


def test_pairs_stay_whole_in_rows_with_their_own_segments():
  pairs = _pairs(12, seed=3)
  ds = _pair_dataset(pairs, seq_len=48)
  rows = ds.rows(np.arange(len(ds)))
  seen = 0
  for r in range(len(ds)):
    members = ds._members[ds._ptr[r] : ds._ptr[r + 1]]
    assert len(members) % 2 == 0 and all(members[0::2] + 1 == members[1::2])
    for slot, e in enumerate(members):
      ids, lab = pairs[e // 2][e % 2]
      at = rows["segment_ids"][r] == slot + 1
      np.testing.assert_array_equal(rows["input_ids"][r][at], ids[:-1])
      np.testing.assert_array_equal(rows["labels"][r][at], lab[1:])
      np.testing.assert_array_equal(rows["positions"][r][at], np.arange(len(ids) - 1))
      seen += 1
  assert seen == 24 and ds.examples == 12 and ds.max_segments > 2


def test_long_pairs_are_truncated_or_counted_and_dropped(tok, tmp_path):
  def row(prompt_words, chosen_words, rejected_words):
    return {
      "prompt": " ".join(["ask"] * prompt_words),
      "chosen": " " + " ".join(["yes"] * chosen_words),
      "rejected": " " + " ".join(["no"] * rejected_words),
    }

  rows = [row(2, 3, 4), row(2, 40, 3), row(2, 40, 40), row(30, 3, 3), row(2, 3, 3)]
  rows.append({"prompt": "same", "chosen": " x", "rejected": " x"})
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  ds, _, report = data_tokenize.load(str(path), tok, DataSettings(seq_len=48))
  line = report.line()
  assert "preference, 6 pairs" in line
  assert "3 pairs longer than seq-len truncated" in line  # rows 2, 3 and 4
  assert "1 pairs whose prompt leaves no room for a response within seq-len dropped" in line
  assert "1 pairs with identical chosen and rejected dropped" in line
  assert ds.examples == 4
  lengths = ds._lengths.reshape(-1, 2)
  assert (lengths.sum(axis=1) <= 48).all()
  short_side = [p for p in lengths if min(p) < 24]  # the long pair with a short side
  assert any(p.sum() == 48 and max(p) > 24 for p in short_side)
  assert any((p == 24).all() for p in lengths)  # both long: half each
  settings = DataSettings(seq_len=48, long_examples="drop")
  _, _, dropped = data_tokenize.load(str(path), tok, settings)
  assert "3 pairs longer than seq-len dropped" in dropped.line()


# ---------------------------------------------------------------- learning, the command line


def _task_rows(n: int, seed: int) -> list[dict]:
  """Chosen: a colour for a colour question; rejected: an animal (a wrong kind of answer)."""
  rng = np.random.default_rng(seed)
  colours = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
  animals = ["cat", "dog", "horse", "mouse", "lion", "sheep", "goat", "duck"]
  things = ["car", "house", "shirt", "door", "cup", "ball", "hat", "box", "pen", "bag"]
  return [
    {
      "prompt": [{"role": "user", "content": f"What colour is the {rng.choice(things)}?"}],
      "chosen": [{"role": "assistant", "content": f"It is {rng.choice(colours)}."}],
      "rejected": [{"role": "assistant", "content": f"It is {rng.choice(animals)}."}],
    }
    for _ in range(n)
  ]


@background_run("dpo_cli_run")
def _dpo_cli_run(directory, runs):
  """`python -m jaxtune.train --method dpo` on the built-in model: 64 training pairs, 16
  held out, 16 steps, a PEFT export. Returns (run directory, the finished process)."""
  train_path, eval_path = directory / "train.jsonl", directory / "eval.jsonl"
  train_path.write_text("".join(json.dumps(r) + "\n" for r in _task_rows(64, 0)))
  eval_path.write_text("".join(json.dumps(r) + "\n" for r in _task_rows(16, 1)))
  out = directory / "run"
  argv = [
    sys.executable, "-m", "jaxtune.train", "--method", "dpo", "--data", str(train_path),
    "--eval-data", str(eval_path), "--beta", "0.1", "--steps", "16", "--batch-size", "8",
    "--learning-rate", "2e-3", "--eval-every", "16", "--export", "peft", "--seq-len", "64",
    "--report-to", "none", "--out", str(out),
  ]  # fmt: skip
  return out, run_cli(argv)


@pytest.mark.slow
def test_dpo_learns_to_prefer_the_right_answers_on_held_out_pairs(dpo_cli_run):
  out, proc = dpo_cli_run
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "dpo (beta 0.1; reference: the adapters off)" in proc.stdout
  rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in rows if "loss" in r]
  # B = 0: the policy is the reference. bfloat16: the two forwards round differently, so the
  # margin is ~0, not exactly 0, and the loss (log 2 - margin / 2 near 0) ~log 2.
  assert abs(train[0]["reward_margin"]) < 0.01
  assert abs(train[0]["loss"] - math.log(2)) < 5e-3
  (final,) = [r for r in rows if "eval_loss" in r]
  assert final["eval_pairs"] == 16
  assert final["eval_reward_accuracy"] >= 0.9, final
  assert final["eval_reward_margin"] > 0 and final["eval_loss"] < math.log(2)
  assert "reward accuracy" in proc.stderr
  assert (out / "export" / "adapter_config.json").is_file()

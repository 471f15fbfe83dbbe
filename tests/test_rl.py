"""GRPO (--method grpo): the objective and its LoRA gradients against a formula reference on
transformers + peft, advantages, rewards, learning a toy task on CPU (and not at a zero
learning rate), an exact resume, and one update under a 2x4 mesh. Bad input is in
test_catalogue.py."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
  MESH_SHAPE,
  assert_lora_grads_match_peft,
  build_hf_llama,
  copy_peft_lora_into,
  mesh_lora_model,
  peft_with_random_adapters,
)
from flax import nnx

import jaxtune
from jaxtune import data, rewards, rl, runtime, trainer
from jaxtune.run_config import RunConfig

IGNORE = data.IGNORE


def _rows(n: int, t: int, seed: int) -> dict[str, np.ndarray]:
  """n rows of a random prompt and completion each, laid out as rl.Rollouts lays them out."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((n, t), np.int32)
  labels = np.full((n, t), IGNORE, np.int32)
  segments = np.zeros((n, t), np.int32)
  for r in range(n):
    p, c = int(rng.integers(2, 6)), int(rng.integers(2, 9))
    seq = rng.integers(1, 256, p + c)
    ids[r, : p + c - 1] = seq[:-1]
    labels[r, p - 1 : p + c - 1] = seq[p:]
    segments[r, : p + c - 1] = 1
  positions = np.tile(np.arange(t, dtype=np.int32), (n, 1)) * (segments > 0)
  return {"input_ids": ids, "labels": labels, "segment_ids": segments, "positions": positions}


def _torch_token_log_probs(model, ids, labels) -> torch.Tensor:
  logits = model(torch.from_numpy(ids).long()).logits.float()
  logp = torch.log_softmax(logits, -1)
  safe = torch.from_numpy(np.where(labels == IGNORE, 0, labels)).long()
  return logp.gather(-1, safe[..., None])[..., 0]


def test_grpo_objective_and_lora_gradients_match_the_formula(tmp_path):
  """TRL 1.16's default GRPO loss ("dapo"), written out on transformers' logits: clipped
  ratios against fixed rollout log-probs (some ratios outside the clip range), the KL to the
  adapters disabled, summed over completion tokens and divided by their count."""
  hf = build_hf_llama(9)
  hf.save_pretrained(tmp_path / "llama")
  peft_model = peft_with_random_adapters(hf, rank=4, alpha=8, seed=2)
  model = jaxtune.apply_lora(
    jaxtune.from_pretrained(tmp_path / "llama", quantization=None, dtype="float32"),
    rank=4,
    alpha=8,
  )
  copy_peft_lora_into(model, peft_model)
  batch = _rows(6, 16, seed=1)
  rng = np.random.default_rng(3)
  batch["advantages"] = rng.normal(size=6).astype(np.float32)
  mask = batch["labels"] != IGNORE
  beta, eps = 0.04, 0.2

  logp = _torch_token_log_probs(peft_model, batch["input_ids"], batch["labels"])
  # Rollout log-probs off by up to +-0.5: some ratios leave [0.8, 1.2], so the clip matters.
  old = logp.detach() + torch.from_numpy(rng.uniform(-0.5, 0.5, logp.shape).astype(np.float32))
  with torch.no_grad(), peft_model.disable_adapter():
    ref = _torch_token_log_probs(peft_model, batch["input_ids"], batch["labels"])
  ratio = torch.exp(logp - old)
  adv = torch.from_numpy(batch["advantages"])[:, None]
  per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
  per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
  m = torch.from_numpy(mask).float()
  torch_loss = (per_token * m).sum() / m.sum()
  peft_model.zero_grad()
  torch_loss.backward()
  clipped = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
  assert 0 < float((clipped.float() * m).sum()) < float(m.sum())  # both branches are taken

  batch["old_logps"] = old.detach().numpy()
  objective = rl.GRPO(beta=beta, epsilon=eps)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  jbatch = {k: jnp.asarray(v) for k, v in batch.items()}

  def mean_loss(lo):
    s, n, aux = objective(graphdef, lo, frozen, jbatch, None, runtime.DEFAULT)
    return s / n, (n, aux)

  (loss, (n, aux)), grads = jax.value_and_grad(mean_loss, has_aux=True)(lora)
  assert int(n) == mask.sum()
  np.testing.assert_allclose(float(loss), torch_loss.item(), rtol=1e-5)
  assert assert_lora_grads_match_peft(model, grads, peft_model) == 14
  np.testing.assert_allclose(float(aux["clip_fraction"]), float((clipped.float() * m).sum()))


def test_group_advantages_are_normalised_within_each_group():
  r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
  a = rl.group_advantages(r, 4)
  t = torch.tensor(r).view(2, 4)  # TRL: (r - mean) / (std + 1e-4), torch's std (Bessel)
  want = ((t - t.mean(1, keepdim=True)) / (t.std(1, keepdim=True) + 1e-4)).view(-1)
  np.testing.assert_allclose(a, want.numpy(), rtol=1e-6)
  assert (a[4:] == 0).all()  # equal rewards: no signal


def test_built_in_rewards():
  done = rewards.final_answer(
    [""] * 4, ["so the answer is 1,234.", "#### 12", "<answer>Paris</answer>", "I think 7"],
    answer=["1234", "13", "paris", 7],
  )  # fmt: skip
  assert done == [1.0, 0.0, 1.0, 1.0]
  assert rewards.think_format([""] * 2, ["<think>a</think> <answer>b</answer>", "b"]) == [1, 0]
  assert rewards.length_penalty([""], ["x" * 500]) == [-0.5]


def test_a_reward_of_the_wrong_length_or_kind_is_named_with_the_step():
  def short(prompts, completions, **_):
    return [1.0]

  def words(prompts, completions, **_):
    return ["good" for _ in completions]

  for fn, match in (
    (short, "returned 1 values for 2 completions at step 7"),
    (words, "returned a value that is not a number at step 7"),
  ):
    with pytest.raises(jaxtune.UserError, match=f"reward {fn.__name__} {match}"):
      rewards.score([(fn.__name__, fn)], ["p", "q"], ["a", "b"], {}, step=7)


# ---------------------------------------------------------------- learning, resume


@pytest.fixture(scope="module")
def toy_task(tmp_path_factory):
  """A directory with 32 chat prompts and a reward module: 1 when a completion holds "a"."""
  root = tmp_path_factory.mktemp("grpo")
  rows = [
    {"prompt": [{"role": "user", "content": f"Question {i}: is it good?"}]} for i in range(32)
  ]
  (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (root / "toy_rewards.py").write_text(
    "def has_a(prompts, completions, **columns):\n"
    "  return [1.0 if 'a' in c else 0.0 for c in completions]\n"
  )
  return root


def _grpo(toy_task, out, monkeypatch, **settings):
  monkeypatch.syspath_prepend(str(toy_task))
  run_dir, _ = jaxtune.train(
    data=toy_task / "prompts.jsonl", method="grpo", reward="toy_rewards:has_a",
    num_generations=4, batch_size=4, max_new_tokens=8, warmup_steps=0, schedule="constant",
    out=str(out), export=None, report_to="none", save_every=3, **settings,
  )  # fmt: skip
  return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_learns_a_toy_task_and_resumes_exactly(toy_task, tmp_path, monkeypatch, capsys):
  rows = _grpo(toy_task, tmp_path / "run", monkeypatch, steps=4, learning_rate=5e-3)
  assert "grpo (toy_rewards:has_a; epsilon 0.2, no KL term" in capsys.readouterr().out
  reward = [r["reward"] for r in rows]
  assert reward[0] < 0.7 and min(reward[-2:]) >= 0.8, reward  # learned (from ~0.2-0.4)
  for key in ("reward/toy_rewards:has_a", "kl", "clip_fraction", "completion_length", "rollout_s"):
    assert key in rows[-1], key
  # At (almost) zero learning rate the reward stays at its starting level: the check can fail.
  still = _grpo(toy_task, tmp_path / "still", monkeypatch, steps=3, learning_rate=1e-9)
  assert max(r["reward"] for r in still) < 0.7, [r["reward"] for r in still]
  # Resumed from step 3, the same rollouts (sampling keys) and updates as uninterrupted.
  shutil.copytree(tmp_path / "run", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  metrics = tmp_path / "resumed" / "metrics.jsonl"
  metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
  monkeypatch.syspath_prepend(str(toy_task))
  jaxtune.train(
    data=toy_task / "prompts.jsonl", method="grpo", reward="toy_rewards:has_a",
    num_generations=4, batch_size=4, max_new_tokens=8, warmup_steps=0, schedule="constant",
    out=str(tmp_path / "resumed"), export=None, report_to="none", save_every=3, steps=4,
    learning_rate=5e-3, resume=True,
  )  # fmt: skip
  again = [json.loads(x) for x in metrics.read_text().splitlines()]
  keys = ("loss", "reward", "grad_norm", "completion_length")
  assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows]


# ---------------------------------------------------------------- a mesh


def test_grpo_update_under_a_mesh_equals_one_device(tmp_path):
  """One GRPO update of fixed completions (rollouts given), 2x4 against one device."""
  path = tmp_path / "llama"
  build_hf_llama(11, **MESH_SHAPE).save_pretrained(path)
  host = _rows(16, 32, seed=4)
  host["advantages"] = np.random.default_rng(5).normal(size=16).astype(np.float32)
  host = {k: v.reshape(2, 8, *v.shape[1:]) for k, v in host.items()}

  def losses(spec):
    run = RunConfig(
      out=str(tmp_path / spec), steps=2, batch_size=16, grad_accum=2, learning_rate=1e-2,
      warmup_steps=0, dtype="float32", lora_rank=4, remat="full", method="grpo", beta=0.04,
    )  # fmt: skip
    (tmp_path / spec).mkdir()
    rt, model = mesh_lora_model(path, run, spec)
    fixed = lambda i, graphdef, lora, frozen: (host, {})  # noqa: E731
    _, history = trainer.train(
      model, None, run, rt, objective=rl.GRPO.from_run(run), rollouts=fixed
    )
    return np.array([[h["loss"], h["kl"]] for h in history])

  one = losses("1")
  assert one[1, 1] > 0  # after one update the policy has left the reference
  np.testing.assert_allclose(losses("2x4"), one, rtol=2e-5, atol=1e-7)

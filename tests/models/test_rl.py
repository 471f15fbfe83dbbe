"""GRPO (--method grpo): the objective and its LoRA gradients against a formula reference on
transformers + peft, advantages, rewards, learning a toy task on CPU (and not at a zero
learning rate), an exact resume, and one update under a 2x4 mesh. Bad input is in
test_catalogue.py."""

import functools
import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
  MESH_SHAPE,
  assert_lora_grads_match_peft,
  background_run,
  build_hf_llama,
  copy_peft_lora_into,
  mesh_lora_model,
  peft_with_random_adapters,
  run_cli,
)
from flax import nnx

import jaxtune
from jaxtune.data import rows as data
from jaxtune.parallel import runtime
from jaxtune.run_config import RunConfig
from jaxtune.training import rewards, rl

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


@pytest.mark.slow
def test_grpo_objective_and_lora_gradients_match_the_formula(tmp_path):
  """TRL 1.16's default GRPO loss ("dapo"), written out on transformers' logits: clipped
  ratios against fixed rollout log-probs (some ratios outside the clip range), the KL to the
  adapters disabled, summed over completion tokens and divided by their count."""
  hf = build_hf_llama(9, num_hidden_layers=2)
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

  (loss, (n, aux)), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(lora)
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


@background_run("grpo_cli_runs")
def _grpo_cli_runs(directory, runs):
  """`python -m jaxtune.train --method grpo` on the built-in model, on a toy task (32 chat
  prompts; reward 1 when a completion holds "a"): 3 steps at learning rate 5e-3, 2 at 1e-9,
  5 with two updates per rollout (--num-iterations 2) and that run resumed in a copy from its
  step-3 checkpoint (mid-rollout). Returns {name: (run directory, finished process)} for
  "learn", "still", "iter", "resumed"."""
  rows = [
    {"prompt": [{"role": "user", "content": f"Question {i}: is it good?"}]} for i in range(32)
  ]
  (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (directory / "toy_rewards.py").write_text(
    "def has_a(prompts, completions, **columns):\n"
    "  return [1.0 if 'a' in c else 0.0 for c in completions]\n"
  )

  def train(name, *flags):
    argv = [
      sys.executable, "-m", "jaxtune.train", "--method", "grpo", "--data", "prompts.jsonl",
      "--reward", "toy_rewards:has_a", "--num-generations", "4", "--batch-size", "4",
      "--max-new-tokens", "8", "--warmup-steps", "0", "--schedule", "constant",
      "--export", "none", "--report-to", "none", "--out", name, *flags,
    ]  # fmt: skip
    return directory / name, run_cli(argv, cwd=directory)

  done = {
    "learn": train("learn", "--steps", "3", "--learning-rate", "5e-3"),
    "still": train("still", "--steps", "2", "--learning-rate", "1e-9"),
  }
  iters = ("--steps", "5", "--learning-rate", "5e-3", "--num-iterations", "2", "--save-every", "3")
  done["iter"] = train("iter", *iters)
  shutil.copytree(directory / "iter", directory / "resumed")
  shutil.rmtree(directory / "resumed" / "checkpoints" / "5")
  metrics = directory / "resumed" / "metrics.jsonl"
  metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]))
  done["resumed"] = train("resumed", *iters, "--resume")
  return done


def _metrics(out):
  return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_learns_a_toy_task_and_resumes_exactly(grpo_cli_runs):
  for name, (_, proc) in grpo_cli_runs.items():
    assert proc.returncode == 0, (name, proc.stderr[-2000:])
  out, proc = grpo_cli_runs["learn"]
  assert "grpo (toy_rewards:has_a; epsilon 0.2, no KL term" in proc.stdout
  rows = _metrics(out)
  reward = [r["reward"] for r in rows]
  assert reward[0] < 0.7 and reward[-1] >= 0.8, reward  # learned in two updates (from ~0.3)
  for key in ("reward/toy_rewards:has_a", "kl", "clip_fraction", "completion_length", "rollout_s"):
    assert key in rows[-1], key
  # At (almost) zero learning rate the reward stays at its starting level: the check can fail.
  still = [r["reward"] for r in _metrics(grpo_cli_runs["still"][0])]
  assert max(still) < 0.7, still
  # Another learning rate and step count: the same compiled step (the numbers are its
  # argument), read back instead of compiled.
  assert "(from the compilation cache)" in grpo_cli_runs["still"][1].stdout
  # Two updates per rollout, resumed from step 3, between the two updates of the second
  # rollout: step 4 trains on the rollout the checkpoint kept (sampling it again from the
  # step-3 adapters would give other completions), step 5 samples the third rollout from
  # its seed: the same rollouts and updates as uninterrupted.
  rows = _metrics(grpo_cli_runs["iter"][0])
  again = _metrics(grpo_cli_runs["resumed"][0])
  assert [r["step"] for r in again] == [1, 2, 3, 4, 5]
  keys = ("loss", "reward", "grad_norm", "completion_length", "clip_fraction")
  assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows]
  assert rows[2]["reward"] == rows[3]["reward"] != rows[4]["reward"]  # rollouts 2 and 3


# ---------------------------------------------------------------- meshes


@pytest.mark.slow
@pytest.mark.beside
def test_dpo_and_grpo_under_meshes_equal_one_device(tmp_path):
  """The DPO loss (pairs packed two to a row) and its LoRA gradients under 2x4 and 1x2x2 (a
  pipeline), and the GRPO loss (fixed completions, the KL on) and gradients under 2x4, equal
  one device."""
  from test_preference import _pair_dataset, _pairs

  from jaxtune.parallel import distributed
  from jaxtune.training import preference, step

  path = tmp_path / "llama"
  build_hf_llama(11, **MESH_SHAPE).save_pretrained(path)
  pairs = _pair_dataset(_pairs(12, seed=5), seq_len=32)
  dpo_rows = pairs.rows(np.arange(4))
  assert pairs.max_segments == 4
  grpo_rows = {**_rows(4, 32, seed=4), "advantages": np.float32([0.5, -1.0, 1.5, -0.3])}
  run = RunConfig(batch_size=4, dtype="float32", lora_rank=4, remat="full", beta=0.04)

  def losses_and_grads(spec):
    """[(loss, gradient leaves)] of DPO, then GRPO (not under the pipeline), one program."""
    rt, model = mesh_lora_model(path, run, spec)
    graphdef, lora, frozen = step.place(model, rt)
    lora = jax.tree.map(lambda x: x + 0.01, lora)  # B = 0 would make policy = reference
    at = {2: rt.sharding("batch", "length"), 1: rt.sharding("batch")}
    place = lambda host: {k: distributed.global_batch(v, at[v.ndim]) for k, v in host.items()}  # noqa: E731
    cases = [(preference.Preference("dpo", 0.5, segments=pairs.max_segments), dpo_rows)]
    if spec != "1x2x2":
      cases.append((rl.GRPO(beta=0.04), grpo_rows))
    batches = [place(host) for _, host in cases]

    def mean(objective, batch, lo):
      s, n, _ = objective(graphdef, lo, frozen, batch, None, rt)
      return s / n

    def value_and_grads(lo, batches):
      return [
        jax.value_and_grad(functools.partial(mean, objective, batch))(lo)
        for (objective, _), batch in zip(cases, batches, strict=True)
      ]

    out = jax.jit(value_and_grads)(lora, batches)
    return [(float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]) for loss, grads in out]

  one = losses_and_grads("1")
  assert all(np.abs(g).max() > 0 for _, grads in one for g in grads)
  for spec in ("2x4", "1x2x2"):
    for (loss, grads), (want, want_grads) in zip(losses_and_grads(spec), one, strict=False):
      np.testing.assert_allclose(loss, want, rtol=2e-5, err_msg=spec)
      for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * np.abs(w).max(), err_msg=spec)

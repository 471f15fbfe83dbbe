"""On-policy RL on QLoRA: GRPO with rollouts generated from the very NF4 weights being trained.

Each rollout: a batch of --batch-size prompts (in a seeded order, one permutation per epoch),
--num-generations G completions of each sampled with jaxtune's KV-cache generation from the
current adapters (temperature, top-p, EOS per row; the sampling key a function of the run's
seed and the rollout number, so a resumed run samples what it would have). The reward
functions score each completion (rewards.py; several are summed), and each completion's
advantage is its reward normalised within its group: (r - mean) / (std + 1e-4), std with
Bessel's correction, as TRL computes it.

The update (``GRPO``, TRL 1.16's default "dapo" loss): per completion token, with ratio =
p / p_old,

  loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A) + beta * KL_t
  KL_t   = exp(ref - logp) - (ref - logp) - 1        (ref: the adapters off, as for DPO)

summed over every completion token of the step and divided by their number. p_old is the
rollout policy's probability: with --num-iterations 1 it is the current one (ratio 1, so
the gradient is -A grad log p); with more, each rollout batch serves that many optimizer steps
and p_old is computed once, before the first. Prompts and completions sit in rows of
--seq-len tokens, one completion per row (prompt tokens carry no label).
"""

import dataclasses
import hashlib
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune.data import formats, sources
from jaxtune.data.rows import IGNORE
from jaxtune.errors import DataError
from jaxtune.models import decoding
from jaxtune.parallel.runtime import NO_WORD_CODES, Decode, Runtime
from jaxtune.run_config import RunConfig
from jaxtune.training import rewards
from jaxtune.training.losses import token_log_probs
from jaxtune.training.objective import Objective


@dataclasses.dataclass(frozen=True)
class GRPO(Objective):
  """The clipped policy-gradient objective with a KL penalty (module docstring)."""

  beta: float = 0.0
  epsilon: float = 0.2
  zero_loss_ok = True  # every group's rewards equal: all advantages 0, a loss of exactly 0

  @classmethod
  def from_run(cls, run: RunConfig) -> "GRPO":
    return cls(run.method_beta, run.epsilon)

  @property
  def figures(self) -> dict[str, Any]:
    """The dtypes of what ``__call__`` returns beside the loss (Objective.figures)."""
    return {"tokens": jnp.int32, "kl": jnp.float32, "clip_fraction": jnp.float32}

  def __call__(
    self,
    graphdef: Any,
    lora: nnx.State,
    frozen: nnx.State,
    batch: dict[str, jax.Array],
    key: jax.Array | None,
    runtime: Runtime,
  ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(sum of token losses, completion tokens, {"tokens", "kl", "clip_fraction": sums})."""
    logp = token_log_probs(nnx.merge(graphdef, lora, frozen), batch, key, runtime)
    mask = (batch["labels"] != IGNORE).astype(jnp.float32)
    old = batch.get("old_logps")
    old = jax.lax.stop_gradient(logp) if old is None else old
    ratio = jnp.exp(logp - old)
    adv = batch["advantages"][:, None].astype(jnp.float32)
    low, high = 1.0 - self.epsilon, 1.0 + self.epsilon
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
    kl = jnp.zeros_like(logp)
    if self.beta:
      zero = jax.tree.map(jnp.zeros_like, lora)
      ref = token_log_probs(nnx.merge(graphdef, zero, frozen), batch, None, runtime)
      d = jax.lax.stop_gradient(ref) - logp
      kl = jnp.exp(d) - d - 1.0
      per_token = per_token + self.beta * kl
    clipped = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    figures = {
      "tokens": jnp.sum(mask).astype(jnp.int32),
      "kl": jnp.sum(jax.lax.stop_gradient(kl) * mask),
      "clip_fraction": jnp.sum(clipped * mask),
    }
    return jnp.sum(per_token * mask), jnp.sum(mask).astype(jnp.int32), figures


def group_advantages(rewards_: np.ndarray, group: int) -> np.ndarray:
  """(r - group mean) / (group std + 1e-4), std with Bessel's correction (torch's default)."""
  r = np.asarray(rewards_, np.float64).reshape(-1, group)
  std = r.std(axis=1, ddof=1, keepdims=True)
  return ((r - r.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1).astype(np.float32)


class Prompts:
  """The prompts of a GRPO run: token ids of each (message lists through the chat template,
  with the assistant's generation prompt), its text, and every other column of its row (for
  the rewards). Prompts leaving fewer than ``max_new_tokens`` of ``seq_len`` are dropped and
  counted (``dropped``)."""

  def __init__(
    self,
    data: Any,
    tokenizer: Any,
    *,
    seq_len: int | None,
    max_new_tokens: int,
    max_positions: int | None = None,
    config: str | None = None,
    split: str = "train",
    columns: str | None = None,
  ):
    table, self.name = sources.open_source(data, config, split)
    mapping = formats.parse_columns(columns)  # --data-columns prompt=question
    if mapping:
      missing = [c for c in mapping if c not in (table.column_names or [])]
      if missing:
        raise DataError(
          f"--data-columns names {', '.join(missing)}, which {self.name} does not have."
        )
      table = table.rename_columns(mapping)
    if "prompt" not in (table.column_names or []):
      raise DataError(
        f"--method grpo reads prompts from a 'prompt' column, but {self.name} has "
        f"{', '.join(table.column_names or []) or 'none'}; rename or map it (--data-columns)."
      )
    encoder = formats.Encoder("prompt_completion", tokenizer, name=self.name)
    rows = table.to_list() if hasattr(table, "to_list") else list(table)
    encoded = [self._encode(row, i, tokenizer, encoder) for i, row in enumerate(rows)]
    self.seq_len_auto = seq_len is None
    if seq_len is None:  # the longest prompt and completion, in 64s, within the model's positions
      longest = max(len(ids) for ids, _ in encoded) + max_new_tokens
      seq_len = min(-(-longest // 64) * 64, max_positions or longest + 64)
    self.ids, self.texts, keep = [], [], []
    room = seq_len - max_new_tokens
    for i, (ids, text) in enumerate(encoded):
      if len(ids) <= room:
        self.ids.append(list(ids))
        self.texts.append(text)
        keep.append(i)
    self.examples, self.dropped, self.max_new_tokens = (
      len(rows),
      len(rows) - len(keep),
      max_new_tokens,
    )
    if not keep:
      raise DataError(
        f"no prompt of {self.name} leaves room for --max-new-tokens {max_new_tokens} within "
        f"--seq-len {seq_len}; raise --seq-len or lower --max-new-tokens."
      )
    others = [c for c in (table.column_names or []) if c != "prompt"]
    self.columns = {c: [rows[i][c] for i in keep] for c in others}
    self.seq_len = seq_len
    self.format = "prompts"

  def fingerprint(self) -> str:
    """A digest of every prompt's tokens and text and of the reward columns (as data.Dataset's:
    a resumed run tells whether its prompts are still those its checkpoint saw)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([self.seq_len, self.ids, self.texts]).encode())
    h.update(json.dumps(self.columns, sort_keys=True, default=repr).encode())
    return h.hexdigest()

  @staticmethod
  def _encode(row: dict, i: int, tokenizer: Any, encoder: formats.Encoder):
    prompt = row["prompt"]
    where = f"{encoder.name} row {i + 1}"
    if isinstance(prompt, str) and prompt:
      return tokenizer(prompt, add_special_tokens=True)["input_ids"], prompt
    if isinstance(prompt, list) and prompt and encoder.chat:
      text = encoder.generation_prompt(prompt, where)
      return tokenizer(text, add_special_tokens=False)["input_ids"], text
    raise DataError(f"{where}: 'prompt' must be a non-empty string or message list.")

  def line(self) -> str:
    """The start line's data part."""
    how = "chosen: the longest prompt and --max-new-tokens" if self.seq_len_auto else "set"
    parts = [
      f"data {self.name}: prompts, {self.examples:,} prompts; seq-len {self.seq_len} ({how})"
    ]
    if self.dropped:
      parts.append(
        f"{self.dropped} prompts longer than seq-len minus --max-new-tokens "
        f"({self.seq_len - self.max_new_tokens}) dropped"
      )
    return "; ".join(parts)

  def __len__(self) -> int:
    return len(self.ids)

  def indices(self, rollout: int, n: int, seed: int) -> np.ndarray:
    """The prompts of rollout ``rollout``: the next ``n`` of a seeded order, reshuffled each
    epoch (a pure function of the rollout number)."""
    flat = np.arange(rollout * n, (rollout + 1) * n)
    epoch, within = np.divmod(flat, len(self))
    out = np.empty_like(within)
    for e in np.unique(epoch):
      order = np.random.default_rng([seed, int(e), 0x6770]).permutation(len(self))
      out[epoch == e] = order[within[epoch == e]]
    return out


class Rollouts:
  """Batches of a GRPO run: ``rollouts(step, graphdef, lora, frozen)`` samples completions
  from the current adapters every --num-iterations steps, scores them and lays them out as
  the step takes them; also the step's rollout figures (rewards per function, lengths, time).
  --batch-size counts prompts: a step trains on batch-size x num-generations rows."""

  def __init__(
    self, prompts: Prompts, tokenizer: Any, run: RunConfig, runtime: Runtime,
    decode: Decode = NO_WORD_CODES,
  ):  # fmt: skip
    """``runtime``: the step's (the old policy's log-probabilities); ``decode``: how the
    rollouts generate (the run's ``Plan.decode``)."""
    self.prompts, self.tok, self.run, self.runtime = prompts, tokenizer, run, runtime
    self.decode = decode
    self.fns = rewards.load(run.reward)
    eos = tokenizer.eos_token_id
    self.eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    self.pad = tokenizer.pad_token_id or 0
    self._held: tuple[int, dict, dict] | None = None  # (rollout, host batch, figures)
    self._old = None

  def __call__(
    self, step: int, graphdef: Any, lora: nnx.State, frozen: nnx.State
  ) -> tuple[dict[str, np.ndarray], dict]:
    """(host batch [accum, micro, ...], figures) of ``step``."""
    rollout = step // self.run.num_iterations
    if self._held is None or self._held[0] != rollout:
      self._held = (rollout, *self._roll(rollout, graphdef, lora, frozen))
    _, host, figures = self._held
    return host, figures

  def state(self, step: int) -> dict | None:
    """What a checkpoint written after ``step`` steps must keep so a resumed run trains on
    the same rollout: the held one while the next step still trains on it (--num-iterations >
    1, mid-group; regenerating it from later adapters would sample other completions), else
    None (the next step samples anew, seeded by its rollout number)."""
    if step % self.run.num_iterations == 0 or self._held is None:
      return None
    rollout, host, figures = self._held
    if rollout != step // self.run.num_iterations:
      return None
    return {"index": rollout, "figures": figures, "host": host}

  def restore(self, saved: dict) -> None:
    """Take back a rollout ``state`` saved mid-group."""
    self._held = (int(saved["index"]), dict(saved["host"]), dict(saved["figures"]))

  def _old_log_probs(self, graphdef, lora, frozen, host) -> np.ndarray:
    """The rollout policy's log-probabilities of the rows' labels (--num-iterations > 1)."""
    if self._old is None:
      rt = self.runtime
      self._old = jax.jit(
        lambda lo, fr, b: token_log_probs(nnx.merge(graphdef, lo, fr), b, None, rt)
      )
    return np.asarray(self._old(lora, frozen, {k: jnp.asarray(v) for k, v in host.items()}))

  def _roll(self, rollout: int, graphdef, lora, frozen) -> tuple[dict, dict]:
    run, g = self.run, self.run.num_generations
    idx = self.prompts.indices(rollout, run.batch_size, run.seed)
    ids = [self.prompts.ids[i] for i in idx for _ in range(g)]
    t0 = time.perf_counter()
    model = nnx.merge(graphdef, lora, frozen)
    completions = decoding.generate_ids(
      model, ids, run.max_new_tokens, self.eos, run.temperature, 0, run.top_p,
      seed=int(np.random.default_rng([run.seed, rollout, 0x5A17]).integers(2**31)),
      pad_id=self.pad, decode=self.decode,
    )  # fmt: skip
    rollout_s = time.perf_counter() - t0
    texts = [self.tok.decode(c, skip_special_tokens=True) for c in completions]
    prompts = [self.prompts.texts[i] for i in idx for _ in range(g)]
    columns = {k: [v[i] for i in idx for _ in range(g)] for k, v in self.prompts.columns.items()}
    scored = rewards.score(self.fns, prompts, texts, columns, rollout * run.num_iterations + 1)
    total = np.sum([scored[n] for n, _ in self.fns], axis=0)
    host = self.rows(ids, completions, group_advantages(total, g))
    if run.num_iterations > 1:
      host["old_logps"] = self._old_log_probs(graphdef, lora, frozen, host)
    lengths = np.array([len(c) for c in completions])
    figures = {
      "reward": float(np.mean(total)),
      "reward_std": float(np.std(total)),
      **{f"reward/{n}": float(np.mean(v)) for n, v in scored.items()},
      **{f"reward_std/{n}": float(np.std(v)) for n, v in scored.items()},
      "completion_length": float(lengths.mean()),
      "rollout_s": rollout_s,
      "rollout_tokens_per_s": float(lengths.sum()) / max(rollout_s, 1e-9),
    }
    accum = run.grad_accum
    host = {k: v.reshape(accum, v.shape[0] // accum, *v.shape[1:]) for k, v in host.items()}
    return host, figures

  def rows(self, prompts: list, completions: list, advantages: np.ndarray) -> dict:
    """One row per completion: inputs prompt + completion, labels the completion's tokens
    (the next token at each position; IGNORE on the prompt), advantage per row."""
    n, t = len(prompts), self.prompts.seq_len
    ids = np.full((n, t), self.pad, np.int32)
    labels = np.full((n, t), IGNORE, np.int32)
    segments = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
      seq = (list(p) + list(c))[: t + 1]
      k = len(seq) - 1
      ids[r, :k] = seq[:k]
      labels[r, len(p) - 1 : k] = seq[len(p) : k + 1]
      segments[r, :k] = 1
      positions[r, :k] = np.arange(k)
    return {
      "input_ids": ids,
      "labels": labels,
      "segment_ids": segments,
      "positions": positions,
      "advantages": np.asarray(advantages, np.float32),
    }

"""What a run says: its start line's account of the method, and the line that ends it."""

import time
from pathlib import Path

from jaxtune.run_config import RunConfig


def summary(history: list[dict], start_time: float, out: Path, run: RunConfig) -> str:
  """The end-of-run line: losses, tokens, time, and where things are."""
  took, out = duration(time.perf_counter() - start_time), out.resolve()
  if not history:
    return f"jaxtune: nothing left to train (step {run.steps} was reached before); {took}"
  train = [r for r in history if "loss" in r]
  tokens = sum(r["tokens"] for r in train)
  first, last = train[0], train[-1]
  parts = [
    f"trained steps {first['step']}-{last['step']} of {run.steps} in {took}",
    f"loss {first['loss']:.4f} -> {last['loss']:.4f}",
  ]
  evals = [r for r in history if "eval_loss" in r]
  if evals:
    last = evals[-1]
    how = (
      f"perplexity {last['eval_ppl']:.2f}"
      if "eval_ppl" in last
      else f"reward accuracy {last['eval_reward_accuracy']:.3f}"
    )
    parts.append(f"eval loss {last['eval_loss']:.4f} ({how})")
  processed = [r for r in train if "processed_tokens" in r]
  if processed:
    # tok/s counts processed tokens (the progress line's figure), past the first step's
    # compile where there is more than one step.
    timed = processed[1:] or processed
    rate = sum(r["processed_tokens"] for r in timed) / sum(
      r["processed_tokens"] / r["tokens_per_s"] for r in timed
    )
    total = sum(r["processed_tokens"] for r in processed)
    parts.append(f"{total:,} tokens processed ({rate:,.0f} tok/s), {tokens:,} of them trained")
  else:
    parts.append(f"{tokens:,} trained tokens")
  where = [f"checkpoints in {out / 'checkpoints'}", f"metrics in {out / 'metrics.jsonl'}"]
  if run.export:
    where.append(f"{run.export} export in {out / 'export'}")
  return "jaxtune: " + ", ".join(parts) + "; " + ", ".join(where)


def method(run: RunConfig) -> str:
  """The preference or RL method and its settings, for the start line."""
  if run.method == "grpo":
    kl = f"KL {run.method_beta:g} to the adapters off" if run.method_beta else "no KL term"
    return (
      f"grpo ({run.reward}; epsilon {run.epsilon:g}, {kl}, temperature {run.temperature:g}"
      f", {run.num_iterations} step(s) per rollout)"
    )
  if run.method == "orpo":
    return f"orpo (lambda {run.orpo_lambda:g})"
  beta = run.method_beta
  smoothing = f", label smoothing {run.label_smoothing:g}" if run.label_smoothing else ""
  return f"{run.method} (beta {beta:g}{smoothing}; reference: the adapters off)"


def duration(seconds: float) -> str:
  m, s = divmod(int(round(seconds)), 60)
  h, m = divmod(m, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"

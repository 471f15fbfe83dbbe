"""Orbax checkpoints of a run: adapters, optimizer state (with the float16 loss scale), RNG key
and data position.

Orbax writes each step under a temporary name and renames it only when complete, so a run
killed mid-save (or a disk that fills up) leaves the previous checkpoint intact; leftover
temporary directories are removed when the next run opens the directory. Only the last
``keep`` steps are kept. A checkpoint that cannot be read is reported, moved aside to
``checkpoints.damaged/`` (never deleted; the run can then save that step again) and the one
before it used. The frozen base weights are never saved: they are re-read from the HF checkpoint.

With several processes every one of them calls ``save`` and ``restore_latest`` (orbax
coordinates the collective write); the directory must be on storage all of them share.
"""

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxtune.errors import RestoreError, SaveError
from jaxtune.training.files import full_disk


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0][:200] if text else type(e).__name__


def _say(message: str) -> None:
  if jax.process_index() == 0:
    print(f"jaxtune: {message}", file=sys.stderr, flush=True)


class _HandledHere(logging.Filter):
  """orbax logs a failed write or read with its traceback (and asyncio its closed event loops)
  before the error reaches us, where it becomes one sentence: drop those records, and absl's
  warning that a reader's directory is read only (it is meant to be)."""

  NOISE = ("Given directory is read only", "Event loop is closed")

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and "/orbax/" in record.pathname.replace("\\", "/"):
      return False
    message = record.getMessage()
    return not any(n in message for n in self.NOISE)


def _quiet_orbax() -> None:
  for name in ("absl", "asyncio"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _HandledHere) for f in logger.filters):
      logger.addFilter(_HandledHere())


@jax.jit
def _sum(x: jax.Array) -> jax.Array:
  """[2] uint32: the sum of the array's 32-bit words and the sum weighted by position (both
  wrapping), so a changed, lost or moved value changes them."""
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    bits = jnp.dtype(x.dtype).itemsize * 8
    words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)
  words = words.reshape(-1)
  position = jnp.arange(1, words.size + 1, dtype=jnp.uint32)
  return jnp.stack([words.sum(dtype=jnp.uint32), (words * position).sum(dtype=jnp.uint32)])


def checksum(state: dict) -> list[list[int]]:
  """The checksum saved with a checkpoint (in its JSON metadata) and compared on restore: two
  32-bit sums per array, computed where the arrays are (sharded arrays too)."""
  # One program per array: the arrays of a state may sit on different devices (a restored
  # PRNG key on one, the sharded LoRA on the mesh), which one program cannot take together.
  out = []
  for leaf in jax.tree.leaves(state):
    sums = _sum(leaf)
    if not sums.is_fully_addressable:  # several processes: every one gets the (tiny) array
      from jax.experimental import multihost_utils

      sums = multihost_utils.process_allgather(sums, tiled=True)
    out.append(np.asarray(jax.device_get(sums)).tolist())
  return out


class Checkpoints:
  def __init__(
    self,
    directory: str | Path,
    keep: int = 2,
    read_only: bool = False,
    data_fingerprint: str | None = None,
  ):
    """``read_only``: for readers of a run (export, generate), which may run while it trains
    and must not clean up its checkpoint in progress (nor move a damaged one aside).
    ``data_fingerprint``: the training data's (data.Dataset.fingerprint), saved with every
    checkpoint so that a resume can tell the data changed (``saved_data_fingerprint``)."""
    _quiet_orbax()
    self.data_fingerprint = data_fingerprint
    self.directory = Path(directory).absolute()
    self.read_only = read_only
    # Made here (orbax creates it): removed again by close() while no checkpoint is in it.
    self.made = not read_only and not self.directory.exists()
    self.manager = ocp.CheckpointManager(
      self.directory,
      item_handlers={
        "state": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
        "rollout": ocp.StandardCheckpointHandler(),
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        create=not read_only,
        read_only=read_only,
        # A save returns once the checkpoint is on disk: then a preempted run can exit at
        # once, and a failed write surfaces here rather than on a background thread.
        enable_async_checkpointing=False,
        cleanup_tmp_directories=not read_only,
      ),
    )

  def save(
    self, step: int, state: dict, data: dict | None = None, rollout: dict | None = None
  ) -> None:
    """Write ``state`` (a dict of pytrees; ``state["key"]`` a typed PRNG key) as ``step``;
    ``data``: a streamed dataset's position (data.streaming.StreamingDataset.state);
    ``rollout``: a GRPO rollout the next steps still train on (rl.Rollouts.state: {"index",
    "figures", "host"}, the host batch's arrays saved beside the state)."""
    state = {**state, "key": jax.random.key_data(state["key"])}
    # The data position is the step (batches are a pure function of it: data.Dataset.batch),
    # and for a stream where it stands in the source.
    meta = {"step": step, "data_position": step, "data": data}
    if self.data_fingerprint is not None:
      meta["data_fingerprint"] = self.data_fingerprint
    items = {"state": ocp.args.StandardSave(state)}
    summed = state
    if rollout is not None:
      meta["rollout"] = {k: v for k, v in rollout.items() if k != "host"}
      items["rollout"] = ocp.args.StandardSave(rollout["host"])
      summed = {**state, "rollout": rollout["host"]}
    meta["checksum"] = checksum(summed)
    previous = self.manager.latest_step()
    try:
      self.manager.save(
        step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)), force=True
      )
    except (OSError, ValueError, RuntimeError) as e:
      self._remove_partial(step)
      kept = f"checkpoint {previous} is intact" if previous is not None else "no earlier checkpoint"
      if full_disk(e):
        raise SaveError(
          f"the disk is full: checkpoint {step} could not be written to {self.directory} "
          f"and {kept}; free some space, then continue with --resume."
        ) from e
      raise SaveError(
        f"checkpoint {step} could not be written to {self.directory} ({_first_line(e)}); {kept}."
      ) from e

  def _remove_partial(self, step: int) -> None:
    """Remove what a failed save of ``step`` left (orbax's temporary directory), from
    process 0, so a full disk gets its space back and nothing half-written stays."""
    if jax.process_index() != 0:
      return
    for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
      shutil.rmtree(partial, ignore_errors=True)

  def close(self) -> None:
    """Close; the directory goes again if this made it and nothing was saved (a run refused
    before its first checkpoint leaves its --out as it was)."""
    self.manager.close()
    if self.made and jax.process_index() == 0:
      with contextlib.suppress(OSError):  # rmdir: only while empty
        self.directory.rmdir()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def saved_data_fingerprint(self) -> tuple[int, str] | None:
    """(step, data fingerprint) of the newest checkpoint, None where it saved none (written
    before fingerprints were kept, or not readable: restoring it reports that)."""
    step = self.manager.latest_step()
    if step is None:
      return None
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      saved = meta["meta"].get("data_fingerprint")
    except Exception:  # noqa: BLE001 (restore_latest reports an unreadable checkpoint)
      return None
    return None if saved is None else (step, saved)

  def restore_latest(self, target: dict) -> tuple[dict, int] | None:
    """(state, step) from the newest checkpoint that reads back, or None when there is none.

    ``target`` is a state like ``save`` takes (arrays give shapes, dtypes and shardings).
    A checkpoint that fails to read is reported and the one before it tried; one whose
    arrays have other shapes than ``target`` raises RestoreError (a different model or LoRA).
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      return None
    target = {**target, "key": jax.random.key_data(target["key"])}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    for i, step in enumerate(steps):
      instead = f"using checkpoint {steps[i + 1]} instead" if i + 1 < len(steps) else ""
      try:
        saved = self.manager.item_metadata(step)
        self._check_shapes(step, saved["state"], abstract)
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if saved.get("rollout") is not None:  # a GRPO rollout kept mid-group
          items["rollout"] = ocp.args.StandardRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
      except RestoreError:
        raise
      except Exception as e:  # orbax and tensorstore raise many types, plain Exception too
        moved = self._move_aside(step)
        where = f"; moved it to {moved}" if moved else ""
        _say(
          f"checkpoint {step} in {self.directory} cannot be read ({_first_line(e)}){where}"
          + (f"; {instead}." if instead else ".")
        )
        continue
      state = dict(restored["state"])
      rollout = restored.get("rollout")
      summed = state if rollout is None else {**state, "rollout": rollout}
      saved_sum = restored["meta"].get("checksum")
      if saved_sum is not None and checksum(summed) != saved_sum:
        moved = self._move_aside(step)
        where = f"; moved it to {moved}" if moved else ""
        _say(
          f"checkpoint {step} in {self.directory} reads back other values than were saved "
          f"(its checksum differs){where}" + (f"; {instead}." if instead else ".")
        )
        continue
      state["key"] = jax.random.wrap_key_data(state["key"])
      state["data"] = restored["meta"].get("data")
      if rollout is not None:
        host = {k: np.asarray(v) for k, v in rollout.items()}
        state["rollout"] = {**restored["meta"]["rollout"], "host": host}
      return state, int(restored["meta"]["step"])
    raise RestoreError(
      f"none of the checkpoints in {self.directory} (steps {', '.join(map(str, steps))}) can be "
      + (
        "read; start a new run with another --out."
        if self.read_only
        else f"read (they are kept in {self.directory.name}.damaged); train again without --resume."
      )
    )

  def _move_aside(self, step: int) -> Path | None:
    """Move a damaged step out of the way (never delete it): to ``checkpoints.damaged/`` beside
    the checkpoints, so the run can save that step again. Not for readers (read_only), and
    only process 0 moves it."""
    if self.read_only:
      return None
    target = None
    if jax.process_index() == 0:
      aside = self.directory.with_name(self.directory.name + ".damaged")
      target = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
      try:
        aside.mkdir(exist_ok=True)
        (self.directory / str(step)).rename(target)
      except OSError:
        target = None
    self.manager.reload()
    return target

  def _check_shapes(self, step: int, saved, abstract: dict) -> None:
    if saved is None or "lora" not in saved or "opt_state" not in saved:
      raise KeyError(f"checkpoint {step} holds no adapters")
    why = {
      "lora": "adapters of other shapes than this run builds (a different model, --lora-rank "
      "or --lora-targets)",
      "opt_state": "optimizer state of another form than this run's (another --dtype: "
      "float16 keeps a loss scale with it)",
    }
    for part in ("lora", "opt_state"):
      want = sorted(tuple(x.shape) for x in jax.tree.leaves(abstract[part]))
      have = sorted(tuple(x.shape) for x in jax.tree.leaves(saved[part]))
      if want != have:
        raise RestoreError(
          f"checkpoint {step} in {self.directory} holds {why[part]}; resume with the settings "
          "it was trained with, or start a new --out."
        )

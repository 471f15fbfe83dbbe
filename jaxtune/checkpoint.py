"""Orbax checkpoints of a run: adapters, optimizer state, RNG key and data position.

Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact; only the last ``keep`` steps are kept.
The frozen base weights are never saved: they are re-read from the HF checkpoint.
"""

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  def __init__(self, directory: str | Path, keep: int = 2):
    self.directory = Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def save(self, step: int, lora, opt_state, key) -> None:
    state = {"lora": lora, "opt_state": opt_state, "key": jax.random.key_data(key)}
    # The data position is the step: batches are a pure function of it (data.Dataset.batch).
    meta = {"step": step, "data_position": step}
    self.manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_latest(self, lora, opt_state):
    """(lora, opt_state, step, key) from the newest checkpoint, or None when there is none."""
    step = self.manager.latest_step()
    if step is None:
      return None
    key = jax.random.key(0)
    target = {"lora": lora, "opt_state": opt_state, "key": jax.random.key_data(key)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
      ),
    )
    state = restored["state"]
    return (
      state["lora"],
      state["opt_state"],
      int(restored["meta"]["step"]),
      jax.random.wrap_key_data(state["key"]),
    )

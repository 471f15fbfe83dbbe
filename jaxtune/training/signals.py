"""SIGTERM and SIGINT during training: the step in progress finishes, a checkpoint is saved,
and ``Stopped`` is raised (a second signal stops at once)."""

import os
import signal
import sys
import threading


class Stopped(Exception):
  """Training stopped on SIGTERM/SIGINT after saving a checkpoint at ``step``."""

  def __init__(self, signum: int, step: int, saved: bool):
    self.signum, self.step, self.saved = signum, step, saved
    super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")


class StopSignals:
  """While active, SIGTERM/SIGINT ask the loop to save and stop after the current step.

  A second signal stops at once (the checkpoint on disk is then the last complete one:
  orbax renames a checkpoint into place only when it is fully written).
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signum: int | None = None
    self.step: int | None = None  # the step in progress (dispatched), which the loop sets
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    if self.signum is not None:
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signum = signum
    which = "the step in progress" if self.step is None else f"step {self.step}, in progress"
    print(
      f"\njaxtune: {signal.Signals(signum).name} received; saving a checkpoint after {which}, "
      "then stopping (send it again to stop at once).",
      file=sys.stderr,
      flush=True,
    )

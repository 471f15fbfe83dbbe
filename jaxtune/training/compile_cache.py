"""The compiled programs kept between runs: JAX's persistent compilation cache, turned on for
the command lines (``use_compile_cache``) in a directory only this user can write, and the
step store beside it (step_store.py: ``StepStore``, whole training steps, signed, read back
without tracing or lowering). ``plan.choose`` looks there first and keeps what it compiled
there.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import sys
import warnings
from pathlib import Path

import jax

# FROM_CACHE and StepStore are step_store's, kept importable from here too (plan.py).
from jaxtune.training import step_store
from jaxtune.training.step_store import FROM_CACHE as FROM_CACHE
from jaxtune.training.step_store import STORE_NAME, STORE_VAR, private_problem
from jaxtune.training.step_store import StepStore as StepStore

GIB = 2**30


class DamagedCacheEntries:
  """While open, JAX's warning that a compilation cache entry cannot be read (cut short by a
  killed run: JAX skips it, compiles anew and, since the file exists, never rewrites it) is
  answered by removing that program's entries, so the next run writes them whole."""

  PATTERN = re.compile(r"Error reading persistent compilation cache entry for '([^']+)'")

  def __enter__(self):
    self._catch = warnings.catch_warnings(record=True)
    self._seen = self._catch.__enter__()
    warnings.simplefilter("always")
    return self

  def __exit__(self, *exc):
    self._catch.__exit__(*exc)
    directory = jax.config.jax_compilation_cache_dir
    for w in self._seen:
      m = self.PATTERN.search(str(w.message))
      if m is None or not directory:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        continue
      for entry in Path(directory).glob(f"{glob.escape(m.group(1))}-*"):
        entry.unlink(missing_ok=True)
      print(
        f"jaxtune: the compilation cache {directory} held a damaged entry for {m.group(1)} "
        "(a run stopped while writing it); compiled anew and removed it.",
        file=sys.stderr,
        flush=True,
      )


_cache_hits = 0  # the persistent compilation cache's hits in this process (jax.monitoring)


def cache_hits() -> int:
  """How many programs this process has read from the persistent compilation cache."""
  return _cache_hits


def _count_cache_hit(event: str, **kwargs) -> None:
  global _cache_hits
  if event == "/jax/compilation_cache/cache_hits":
    _cache_hits += 1


@functools.cache
def listen_for_cache_hits() -> None:
  jax.monitoring.register_event_listener(_count_cache_hit)


CACHE_GIB = 16  # the cache's size limit
CACHE_VAR = "JAXTUNE_COMPILE_CACHE"  # a directory for the compiled programs; "" turns it off


def use_compile_cache(enabled: bool = True) -> Path | None:
  """Turn on JAX's persistent compilation cache for the command lines (a second run, a
  resume, an export or a generate of the same shapes skips compiling); returns its directory.

  The directory: ``$JAXTUNE_COMPILE_CACHE``, else JAX's own setting
  (``JAX_COMPILATION_CACHE_DIR``) when the user made one, else ``~/.cache/jaxtune/xla``
  (``$XDG_CACHE_HOME``). This user's runs may share it: with a size limit (CACHE_GIB, least
  recently used entries evicted; ``JAX_COMPILATION_CACHE_MAX_SIZE`` overrides) jax 0.11.2
  reads and writes entries under a file lock, where without one it writes in place,
  unguarded. An entry cut short (a run killed while writing it) is skipped with a warning and
  compiled anew.
  ``enabled=False`` (``--no-compile-cache``) or an empty ``$JAXTUNE_COMPILE_CACHE`` leave the
  cache off; so does a directory that is not this user's alone (``private_problem``: another
  user's, or writable by others), with one line: a shared cache would run others' programs.
  With the cache on, the training step chosen is also kept whole in its directory
  ``jaxtune-steps`` (``StepStore``; ``JAXTUNE_STEP_STORE=0`` keeps the cache only).
  """
  step_store.keep_steps_in(None)
  place = os.environ.get(CACHE_VAR)
  if not enabled or place == "":
    return None
  if place is None:
    place = jax.config.jax_compilation_cache_dir
  if not place:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    place = os.path.join(base, "jaxtune", "xla")
  try:
    os.makedirs(place, mode=0o700, exist_ok=True)
  except OSError:
    return None  # a read-only home: compile as without the cache
  problem = private_problem(Path(place))
  if problem is not None:
    # Its entries are programs (machine code, and pickles in the step store) that this run
    # would execute: anyone who can write there could run code in every later job.
    print(
      f"jaxtune: the compilation cache is off for this run: {problem}, so the programs it "
      "holds could be anyone's; make it this user's alone (chmod go-w) or set "
      f"${CACHE_VAR} to a directory of your own.",
      file=sys.stderr,
      flush=True,
    )
    jax.config.update("jax_compilation_cache_dir", None)  # JAX's own setting may name it
    return None
  jax.config.update("jax_compilation_cache_dir", place)
  if os.environ.get(STORE_VAR, "1") != "0":
    step_store.keep_steps_in(Path(place) / STORE_NAME)
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", CACHE_GIB * GIB)
  # Every program, not only those of a second or more (JAX's default): the small ones (LoRA
  # and optimizer set-up, placement) cost an 8B run's first step 0.9 s on an H100.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return Path(place)

"""The memory plan of the training step: with ``--remat auto``, the fastest setting that fits.

Before the first step the candidate settings (``Runtime.candidates``: remat policy and loss
chunk, fastest first) are compiled one at a time, XLA's memory plan of each read
(``Compiled.memory_analysis``: arguments + outputs - donated + temporaries, per device), and
the first whose plan fits the budget with a margin is kept: compiled once, that program is
the one the run calls. A candidate is not compiled at all when a floor of its plan, found by
tracing alone (``floor_bytes``: the arguments plus the residuals its forward pass leaves for
the backward pass), already misses the budget. The budget is ``--memory-limit`` when
given, else what the device can allocate (``memory_stats()["bytes_limit"]``, which
``XLA_PYTHON_CLIENT_MEM_FRACTION`` lowers), else (CPU) the machine's memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import hmac
import importlib
import importlib.util
import json
import math
import os
import pickle
import platform
import re
import secrets
import stat
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.extend

from jaxtune.cli import CACHE_HELP  # noqa: F401 (the command lines' --no-compile-cache)
from jaxtune.errors import UserError, size_text
from jaxtune.parallel.runtime import Runtime

GIB = 2**30
# remat -> a faster setting whose plan was smaller in every shape measured (experiments/
# RESULTS.md: Llama 8B 21.3 vs 28.8 GiB, Gemma-2-9B 31.3 vs 41.6, 70B activations over 59 vs
# 89.6, the tiny CPU model 46 vs 58 MiB): not compiled when that one, with the same loss
# chunk, did not fit.
DOMINATED_BY = {"dots_no_batch": "activations"}
# Kept free beside the step's plan: the allocator's fragmentation, the evaluation step, the
# next batch in flight and the runtime's own buffers; at most MARGIN_MOST, as those do not
# grow with the device (70B batch 1 on an H100, 75.2 GiB pool: a plan of 68.9 GiB peaked at
# 68.86 GiB; each GiB more is ~3 layers' activations kept, ~1.1% of the step).
MARGIN_FRACTION = 0.08
MARGIN_MOST = 4 * GIB
# Under full remat, plan.choose keeps the activations of some layers where remat activations
# does not fit, if at least this fraction of the layers fits (~1/3 of their recomputation
# saved each: 3% of the step at this fraction, about what the extra compile costs a short run).
MIN_KEPT_FRACTION = 0.1
# The unrolled layer loop planned 1.4-1.9x the scan's memory wherever measured (Llama 1B
# batch 4, 8B batches 2 and 4; experiments/RESULTS.md), and a floor is at most its plan: not
# compiled where this many times the scan's floor already misses (Llama 70B: that compile ran
# for minutes).
UNROLLED_GROWTH = 1.3


_UNWRITTEN_LOCK = threading.Lock()


@contextlib.contextmanager
def scan_outputs_unwritten(enabled: bool = True) -> Iterator[None]:
  """While lowering: lax.scan's stacked outputs start as allocated, unwritten buffers.

  JAX makes every stacked output of a scan (in a training step: each residual the layer loop
  saves for the backward pass) from a broadcast of zeros, which the loop then overwrites one
  row per step; XLA writes those zeros first (8B batch 2: ~13 GB a step, 4.2 ms of 283 on an
  H100, experiments/RESULTS.md). Here they come from ``jax.lax.empty`` instead: XLA's
  AllocateBuffer on GPU and TPU, zeros elsewhere. Every row is written before it is read, so
  values are unchanged. Outputs off device memory or varying over manual (shard_map) axes
  keep JAX's zeros; so does every output while ``enabled`` is false (plan.choose: steps under
  a mesh, where how the partitioner shards an operand-less custom call is not measured).
  Patches a private JAX function for the duration (restored on exit; one thread at a time).
  """
  if not enabled:
    yield
    return
  from jax._src.lax.control_flow import loops  # noqa: PLC0415 (private: scan's output init)

  def unwritten(prefix, length_spec, aval):
    if (
      not aval.sharding.mesh.empty
      or aval.mat.varying
      or "device" not in str(aval.memory_space).lower()
    ):
      return zeros(prefix, length_spec, aval)
    return jax.lax.empty((*prefix, *aval.shape), aval.dtype)

  with _UNWRITTEN_LOCK:  # one patch at a time: another thread's would be restored wrong
    zeros = loops._empty_array
    loops._empty_array = unwritten
    try:
      yield
    finally:
      loops._empty_array = zeros


@dataclasses.dataclass(frozen=True)
class Plan:
  """The chosen setting, what it plans to use, and what was tried before it."""

  runtime: Runtime
  planned: int  # bytes per device: arguments + outputs - donated + temporaries
  budget: int | None  # bytes per device it had to fit; None: nothing to choose between
  budget_source: str
  # (setting, bytes, compiled) that did not fit: bytes is the compiled plan, or (compiled
  # False) the traced floor that already missed the budget (for layers unrolled and not
  # compiled: UNROLLED_GROWTH x the scan's floor)
  rejected: tuple[tuple[str, int, bool], ...]
  compile_s: float
  cache_hits: int  # programs read from the persistent compilation cache while compiling
  stored: bool = False  # the whole step read back from the step store (no tracing, no lowering)

  @property
  def from_cache(self) -> bool:
    return self.stored or self.cache_hits > 0

  def note(self) -> str:
    """What the start line says of the choice, after the remat setting it names."""
    if self.budget is None:
      note = f"planned {size_text(self.planned)}"
    else:
      note = (
        f"auto: planned {size_text(self.planned)} of {size_text(self.budget)} "
        f"({self.budget_source})"
      )
    if self.rejected:
      name, size, compiled = self.rejected[-1]
      note += f", {name} would " + (
        f"plan {size_text(size)}" if compiled else f"need {size_text(size)}+"
      )
    return note


def planned_bytes(compiled: Any) -> int | None:
  """Device bytes a compiled program holds at its peak, as XLA planned it (None: unknown)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return (
    m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
    + m.temp_size_in_bytes
    + m.generated_code_size_in_bytes
  )


HOST_MEMORY = "host memory"  # device_budget's source where devices report no memory limit


def device_budget(limit_gib: float | None, devices: Sequence | None = None) -> tuple[int, str]:
  """(bytes per device the step may plan for, where that number comes from)."""
  if limit_gib is not None:
    return int(limit_gib * GIB), "--memory-limit"
  devices = list(devices if devices is not None else jax.local_devices())
  limits = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
      limits.append(int(stats["bytes_limit"]))
  if limits:
    return min(limits), devices[0].device_kind
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return int(total), HOST_MEMORY


def floor_bytes(loss: Callable[[Any], Any], lora: Any, args: Sequence) -> int:
  """A floor of a training step's plan per device, without compiling: the bytes of its
  arguments ``args`` (each device's shard), plus the residuals that ``loss`` (a function of
  ``lora``) saves for its backward pass in device memory, spread evenly over the devices. All
  of those residuals are alive at once where the forward pass ends and the backward begins."""
  closed, (_, residuals) = jax.make_jaxpr(lambda p: jax.vjp(loss, p), return_shape=True)(lora)
  count = len(jax.tree.leaves(residuals))
  inputs = {id(v) for v in (*closed.jaxpr.invars, *closed.jaxpr.constvars)}
  saved, seen = 0, set()
  for v in closed.jaxpr.outvars[len(closed.jaxpr.outvars) - count :]:
    if id(v) in inputs or id(v) in seen or isinstance(v, jax.extend.core.Literal):
      continue  # an argument or constant (counted below), or a value written into the program
    seen.add(id(v))
    if "host" in str(getattr(v.aval, "memory_space", "")).lower():
      continue  # offloaded: waits in host memory
    saved += v.aval.size * v.aval.dtype.itemsize
  devices = max(len(leaf.sharding.device_set) for leaf in jax.tree.leaves(args))
  return _argument_bytes(args) + saved // devices


def _argument_bytes(args: Sequence) -> int:
  total = 0
  for leaf in jax.tree.leaves(args):
    shape = leaf.sharding.shard_shape(leaf.shape) if hasattr(leaf, "sharding") else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


def usable(budget: int) -> float:
  """The bytes of ``budget`` a plan may take: less MARGIN_FRACTION of it, at most MARGIN_MOST."""
  return budget - min(MARGIN_FRACTION * budget, MARGIN_MOST)


def fits(planned: int, budget: int) -> bool:
  return planned <= usable(budget)


def choose(
  build: Callable[[Runtime], Any],
  args: tuple,
  runtime: Runtime,
  budget: tuple[int, str],
  logits_bytes: int = 0,
  floor: Callable[[Runtime], int] | None = None,
  identity: str | None = None,
) -> tuple[Any, Plan]:
  """(compiled step, plan): the first of ``runtime.candidates`` whose compiled plan fits
  ``budget``; ``build(runtime)`` returns the jitted step, lowered and compiled here with
  ``args`` (the real first arguments, so the program's layouts are the run's).
  ``logits_bytes``: the float32 logits of one micro-batch on one device; a loss-chunked
  candidate is not compiled when its unchunked twin would not fit even without 4 times that
  (the logits, their gradient and the softmax's temporaries are what chunking saves), and a
  DOMINATED_BY setting is not compiled once the setting that dominates it was refused.
  ``floor(runtime)``: a floor of that candidate's plan found without compiling
  (``floor_bytes``); a candidate whose floor misses the budget is not compiled, nor its
  layers unrolled (also for a forced setting) where UNROLLED_GROWTH times the floor misses.
  Not traced against host memory (a CPU backend without --memory-limit): there the first
  candidate nearly always fits, and the trace cost a second per run (CPU tests: ~40 runs).

  ``identity``: what decides the program ``build`` makes besides ``args``' shapes and
  placement, ``runtime`` and ``budget`` (the model's graphdef, the run's settings that reach
  the program, e.g. the schedule's kind, the objective), as text: with it, and the step
  store on (``use_compile_cache``), the chosen step is kept whole, and a later process with
  the same key reads it back without tracing, lowering or choosing (``_StepStore``).

  Raises a ``UserError`` naming the leanest plan and the levers when none fits.
  """
  t0 = time.perf_counter()
  store = _StepStore.open(identity, args, runtime, budget, logits_bytes)
  if store is not None:
    found = store.load(args)
    if found is not None:
      compiled, (remat, loss_chunk, scan_layers, kept, planned, limit, source, rejected) = found
      rt = runtime.replace(
        remat=remat, loss_chunk=loss_chunk, scan_layers=scan_layers, kept_layers=kept,
        candidates=(), try_unrolled=False, keep_up_to=0,
      )  # fmt: skip
      took = time.perf_counter() - t0
      return compiled, Plan(rt, planned, limit, source, rejected, took, 0, stored=True)
  compiled, chosen = _choose(build, args, runtime, budget, logits_bytes, floor)
  if store is not None:
    store.save(compiled, chosen)
  return compiled, chosen


def _choose(build, args, runtime, budget, logits_bytes, floor) -> tuple[Any, Plan]:
  candidates = runtime.candidates or ((runtime.remat, runtime.loss_chunk),)
  choosing = len(candidates) > 1
  limit, source = budget
  rejected: list[tuple[str, int, bool]] = []
  _listen_for_cache_hits()
  t0, hits = time.perf_counter(), _cache_hits
  with _DamagedCacheEntries():
    # remat -> compiled plan with the logits whole (missed holds traced floors too: the
    # loss-chunk check below reads compiled plans only)
    whole: dict[str, int] = {}
    missed: dict[tuple[str, int], int] = {}  # (remat, loss chunk) -> its plan or floor
    refused: set[tuple[str, int]] = set()
    left_out: list[tuple[str, int, bool]] = []  # unrolled loops not tried: their estimates
    unrolled_tried = False
    for remat, loss_chunk in candidates:
      if loss_chunk and logits_bytes and remat in whole:
        if not fits(whole[remat] - 4 * logits_bytes, limit):
          refused.add((remat, loss_chunk))
          missed[remat, loss_chunk] = whole[remat] - 4 * logits_bytes  # a floor of its plan
          continue
      if (DOMINATED_BY.get(remat), loss_chunk) in refused:
        continue
      rt = runtime.replace(
        remat=remat, loss_chunk=loss_chunk, candidates=(), try_unrolled=False, keep_up_to=0
      )
      # Faster where it fits (--layer-loop auto); ~1.9x the scan's plan at 8B, so tried with
      # the first activations candidate only (not again once it has missed or was refused).
      unroll = runtime.try_unrolled and remat == "activations" and not unrolled_tried
      unrolled_tried = unrolled_tried or remat == "activations"
      if (choosing or unroll) and floor is not None and source != HOST_MEMORY:
        least = floor(rt)
        if choosing and not fits(least, limit):
          rejected.append((f"remat {rt.setting}", least, False))
          refused.add((remat, loss_chunk))
          missed[remat, loss_chunk] = least
          continue
        if unroll and not fits(UNROLLED_GROWTH * least, limit):
          unrolled = rt.replace(scan_layers=False)  # named on the start line as not tried
          left_out.append((f"remat {unrolled.setting}", math.ceil(UNROLLED_GROWTH * least), False))
          rejected.append(left_out[-1])
          unroll = False
      tries = [rt]
      if unroll:
        tries.insert(0, rt.replace(scan_layers=False))
      for rt in tries:
        compiled = _compile(build, rt, args)
        planned = planned_bytes(compiled)
        if rt is tries[-1] or planned is None or fits(planned, limit):
          break
        rejected.append((f"remat {rt.setting}", planned, True))
      if not choosing or planned is None or fits(planned, limit):
        above = missed.get(("activations", loss_chunk))
        keep = remat == "full" and runtime.keep_up_to and choosing
        if keep and above is not None and planned is not None:
          kept = _keep_layers(build, args, rt, planned, above, limit, runtime.keep_up_to, rejected)
          if kept is not None:
            compiled, rt, planned = kept
        plan = Plan(
          rt,
          planned or 0,
          limit if choosing else None,
          source,
          tuple(rejected),
          time.perf_counter() - t0,
          _cache_hits - hits,
        )
        return compiled, plan
      rejected.append((f"remat {rt.setting}", planned, True))
      refused.add((remat, loss_chunk))
      missed[remat, loss_chunk] = planned
      if not loss_chunk:
        whole[remat] = planned
  # The leanest tried (an unrolled loop left out by its scan's floor was not: its twin was)
  tried = [r for r in rejected if r not in left_out]
  name, size, compiled = min(reversed(tried or rejected), key=lambda r: r[1])  # ties: later
  levers = [] if any(r == "offload" for r, _ in candidates) else ["--remat offload"]
  if runtime.remat_group == 1:  # fewer kept layer inputs (long rows)
    levers.append("--remat-group 2 (with full, lean or offload)")
  use = f"use {' or '.join(levers)}, " if levers else ""
  plans = "plans" if compiled else "needs at least"
  raise UserError(
    f"the training step does not fit the {size_text(limit)} of device memory ({source}): the "
    f"leanest setting tried, {name}, {plans} {size_text(size)} per device; {use}lower "
    "--batch-size (with --grad-accum to keep the batch) or --seq-len, or split the model over "
    "more devices with --mesh."
  )


def _keep_layers(build, args, rt, full, above, limit, layers, rejected):
  """(compiled step, runtime, planned bytes) of ``rt`` (remat full, planned ``full`` bytes)
  with the activations of its first layers kept, as many as fit ``limit`` by a straight line
  between full and remat activations (``above``: its plan or floor, all ``layers`` kept),
  then once more by the line through the first try's plan; None where fewer than
  MIN_KEPT_FRACTION of the layers would fit (the speed gained would not pay the compile)."""
  room = usable(limit) - full
  per_layer, most = (above - full) / layers, layers - 1
  for _ in range(2):
    kept = min(most, int(room // per_layer)) if per_layer > 0 else most
    if kept < max(1, math.ceil(MIN_KEPT_FRACTION * layers)):
      return None
    tried = rt.replace(kept_layers=kept)
    compiled = _compile(build, tried, args)
    planned = planned_bytes(compiled)
    if planned is None:
      return None
    if fits(planned, limit):
      return compiled, tried, planned
    rejected.append((f"remat {tried.setting}", planned, True))
    per_layer, most = (planned - full) / kept, kept - 1
  return None


# Programs that JAX read back from its persistent compilation cache. On the CPU such a program,
# serialized again, loses functions: loaded from the step store it fails when it runs
# ("Function multiply_select_fusion not found", jax 0.11.2), and the store would only notice
# at the step, so the store keeps none of them there (a warm start then traces and lowers
# where only the compilation cache holds the step). On an H100 such programs (a Mosaic GPU
# kernel's, an XLA step's) loaded and ran with the same outputs as when first compiled
# (experiments/check_cache_store.py, session 27), so GPUs keep them.
_FROM_CACHE: weakref.WeakSet = weakref.WeakSet()


def _compile(build, rt: Runtime, args) -> Any:
  with scan_outputs_unwritten(enabled=rt.mesh is None):  # one device: see its docstring
    lowered = build(rt).lower(*args)
  _listen_for_cache_hits()
  hits = _cache_hits
  compiled = lowered.compile()
  if _cache_hits > hits:
    _FROM_CACHE.add(compiled)
  return compiled


STORE_NAME = "jaxtune-steps"  # the step store's directory, inside the compilation cache's
STORE_VAR = "JAXTUNE_STEP_STORE"  # "0": the command lines keep no whole steps (the cache only)
STORE_ENTRIES = 8  # whole steps the store keeps; the least recently used go first
_store_dir: Path | None = None  # set by use_compile_cache: the command lines' store


class _StepStore:
  """Whole training steps kept on disk, so that a later run of the same step (a second run,
  a resume) skips tracing, lowering and choosing, which JAX's compilation cache does not:
  its key is the lowered program, so every run traces and lowers the step (an 8B step: ~7 s
  on an H100, half of it the Mosaic kernels' lowering) before it can look.

  An entry's key is a digest of everything the program depends on: ``identity`` (the
  trainer's: graphdef, model config, the run's settings that reach the step, objective),
  the arguments' tree, shapes, dtypes, placements and devices, the runtime, the budget, the
  source of the packages a step runs (SOURCE_PACKAGES), the library versions, the backend
  and JAX's settings (XLA_FLAGS among them). A key that differs in anything compiles anew.

  JAX's serialized executables are pickles (and programs are machine code): an entry runs
  whatever its writer put there, so only this user's own entries are ever read. Before every
  read and write the store's directory must be this user's and writable by no one else, and
  an entry a regular file of this user's (``private_problem``); an entry is then a small
  header (JSON) and the pickled program, and the header's HMAC-SHA256 of both, keyed by a
  secret only this user can read (``KEY_NAME``, mode 0600), is checked before anything else
  of the file is parsed. An entry that fails any check is never unpickled: it is renamed
  ``*.refused`` (kept for whoever looks into it) with one line, and the step compiled anew.
  An entry is written whole or not at all (a temporary file renamed).
  Programs with host callbacks (interpreted Pallas kernels) are not kept, nor, on CPUs,
  programs that JAX read back from its compilation cache (``_FROM_CACHE``)."""

  MAGIC = b"jaxtune step store 2\n"

  def __init__(self, path: Path):
    self.path = path

  @classmethod
  def open(cls, identity, args, runtime, budget, logits_bytes) -> _StepStore | None:
    if identity is None or _store_dir is None or jax.process_count() > 1:
      return None
    h = hashlib.sha256()
    for part in (identity, repr(runtime), repr(budget), str(logits_bytes), _environment()):
      h.update(part.encode() + b"\0")
    h.update(str(jax.tree.structure(args)).encode())
    for leaf in jax.tree.leaves(args):
      sharding = getattr(leaf, "sharding", None)
      mesh = getattr(sharding, "mesh", None)
      ids = getattr(mesh, "device_ids", None)
      if ids is not None:
        ids = ids.tolist()
      elif sharding is not None:
        ids = sorted(d.id for d in sharding.device_set)
      h.update(f"{leaf.shape} {leaf.dtype} {sharding!r} {ids}\0".encode())
    return cls(_store_dir / f"{h.hexdigest()}.step")

  def load(self, args) -> tuple[Any, tuple] | None:
    """(compiled step, its plan's fields), or None where no entry is kept."""
    from jax.experimental import serialize_executable

    try:
      st = os.lstat(self.path)
    except OSError:
      return None
    problem = private_problem(self.path.parent) or _entry_problem(st)
    key = None if problem else _store_key(self.path.parent)
    if key is None:
      self._refuse(problem or "this user's key of the store cannot be read")
      return None
    try:
      header, payload = _read_entry(self.path.read_bytes(), key)
    except ValueError as e:  # not signed by this user's key: never unpickled
      self._refuse(str(e))
      return None
    try:
      program, in_tree, out_tree = pickle.loads(payload)  # signed by this user: their own
      plan_fields = _plan_fields(header["plan"])
      if in_tree != jax.tree.structure((tuple(args), {})):
        raise ValueError("its arguments' tree differs")
      devices = {d.id: d for d in jax.devices()}
      if jax.devices()[0].platform == "gpu":
        # A Mosaic GPU kernel in the program is compiled from its MLIR when the program
        # loads. In the train CLI that failed without this import ("Failed to lookup host
        # symbol ... body_mosaic_gpu", H100, 2 of 2 loads) and worked with it; it sets the
        # runtime library's path for that compiler. (A bare process loaded without it:
        # experiments/check_step_store.py.) Tracing the step imports it otherwise.
        importlib.import_module("jax.experimental.mosaic.gpu")
      compiled = serialize_executable.deserialize_and_load(
        program, in_tree, out_tree, execution_devices=[devices[i] for i in header["devices"]]
      )
    except Exception as e:  # noqa: BLE001 (this user's own entry, of another jax or devices)
      _remove(self.path)
      print(
        f"jaxtune: the step store held an entry that could not be read ({self.path.name}: "
        f"{type(e).__name__}: {e}); compiled anew and removed it.",
        file=sys.stderr,
        flush=True,
      )
      return None
    with contextlib.suppress(OSError):  # removed meanwhile
      os.utime(self.path)  # recently used
    return compiled, plan_fields

  def _refuse(self, why: str) -> None:
    """An entry that is not certainly this user's: never read, renamed aside with one line."""
    aside = self.path.with_name(f"{self.path.name}.refused")
    try:
      os.replace(self.path, aside)
      kept = f"kept as {aside}"
    except OSError:
      kept = "left in place"
    print(
      f"jaxtune: the step store entry {self.path} was not read ({why}); {kept}, and the step "
      "compiled anew.",
      file=sys.stderr,
      flush=True,
    )

  def save(self, compiled: Any, chosen: Plan) -> None:
    """Keep ``compiled`` (best effort: a program that cannot be serialized, or on a CPU one
    that JAX read back from its compilation cache, is not kept; nor anything in a store that
    is not this user's alone)."""
    from jax.experimental import serialize_executable

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or unloaded.host_callbacks or unloaded.keepalive:
      return
    if compiled in _FROM_CACHE and jax.default_backend() == "cpu":  # see _FROM_CACHE
      return
    try:
      payload = pickle.dumps(serialize_executable.serialize(compiled), pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 (not serializable here: the compilation cache still helps)
      return
    rt = chosen.runtime
    fields = (rt.remat, rt.loss_chunk, rt.scan_layers, rt.kept_layers, chosen.planned,
              chosen.budget, chosen.budget_source, chosen.rejected)  # fmt: skip
    header = {"plan": fields, "devices": [d.id for d in unloaded.device_list]}
    directory = self.path.parent
    part = self.path.with_name(f"{self.path.name}.{os.getpid()}.part")
    try:
      directory.mkdir(mode=0o700, parents=True, exist_ok=True)
      key = None if private_problem(directory) else _store_key(directory, create=True)
      if key is None:
        return
      fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(_entry_bytes(header, payload, key))
      os.replace(part, self.path)
    except OSError:  # a full or read-only disk: the run goes on without the entry
      _remove(part)
      return
    kept = sorted(directory.glob("*.step"), key=_mtime, reverse=True)
    for old in kept[STORE_ENTRIES:]:
      _remove(old)
    # What a writer killed mid-write left (an hour old: not a running writer's).
    for left in directory.glob("*.part"):
      if _mtime(left) < time.time() - 3600:
        _remove(left)


KEY_NAME = "key"  # the step store's secret (32 random bytes, mode 0600) in its directory


def private_problem(directory: Path) -> str | None:
  """Why ``directory`` is not this user's alone (None when it is): a symbolic link, not a
  directory, another user's, or writable by its group or by others."""
  try:
    st = os.lstat(directory)
  except OSError as e:
    return f"{directory} cannot be read ({e.strerror})"
  if stat.S_ISLNK(st.st_mode):
    return f"{directory} is a symbolic link"
  if not stat.S_ISDIR(st.st_mode):
    return f"{directory} is not a directory"
  if st.st_uid != os.getuid():
    return f"{directory} belongs to another user (uid {st.st_uid})"
  if st.st_mode & 0o022:
    return f"{directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def _entry_problem(st: os.stat_result) -> str | None:
  if not stat.S_ISREG(st.st_mode):
    return "it is not a regular file"
  if st.st_uid != os.getuid():
    return f"it belongs to another user (uid {st.st_uid})"
  if st.st_mode & 0o022:
    return f"it is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def _store_key(directory: Path, create: bool = False) -> bytes | None:
  """This user's secret of the store in ``directory`` (made on the first write), or None
  where it is missing or could be anyone's (not a private regular file of this user's)."""
  path = directory / KEY_NAME
  if create and not path.exists():
    part = directory / f"{KEY_NAME}.{os.getpid()}.part"
    try:
      fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
      os.link(part, path)  # fails where another writer made one first: theirs is kept
    except FileExistsError:
      pass
    finally:
      _remove(part)
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
  except OSError:
    return None
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
      return None
    key = f.read(64)
  return key if len(key) == 32 else None


def _entry_bytes(header: dict, payload: bytes, key: bytes) -> bytes:
  """MAGIC, the header's length (8 bytes), the header (JSON), the payload; the header holds
  the HMAC of the rest of the header and of the payload."""
  body = json.dumps(header).encode()
  mac = hmac.new(key, body + b"\0" + payload, hashlib.sha256).hexdigest()
  signed = json.dumps({"hmac": mac, "body": body.decode()}).encode()
  return _StepStore.MAGIC + len(signed).to_bytes(8, "little") + signed + payload


def _read_entry(data: bytes, key: bytes) -> tuple[dict, bytes]:
  """(header, payload) of an entry whose HMAC checks out; ValueError otherwise, before any of
  it but the signed header's JSON is parsed."""
  magic = _StepStore.MAGIC
  if not data.startswith(magic) or len(data) < len(magic) + 8:
    raise ValueError("it is not an entry of this jaxtune's step store")
  n = int.from_bytes(data[len(magic) : len(magic) + 8], "little")
  start = len(magic) + 8
  if n > 1 << 20 or start + n > len(data):
    raise ValueError("its header is cut short")
  try:
    signed = json.loads(data[start : start + n])
    body, mac = signed["body"].encode(), signed["hmac"]
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ValueError("its header is damaged") from e
  payload = data[start + n :]
  want = hmac.new(key, body + b"\0" + payload, hashlib.sha256).hexdigest()
  if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
    raise ValueError("it is not signed by this user's key: written by someone else, or damaged")
  return json.loads(body), payload


def _plan_fields(fields: list) -> tuple:
  """The plan's fields as saved (JSON lists back to the tuples Plan holds)."""
  if len(fields) != 8:  # (remat, loss_chunk, scan_layers, kept_layers, planned, ...)
    raise ValueError("its plan has another form")
  *head, rejected = fields
  return (*head, tuple(tuple(r) for r in rejected))


def _remove(path: Path) -> None:
  with contextlib.suppress(OSError):
    path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
  try:
    return path.stat().st_mtime
  except OSError:
    return 0.0


# The packages whose code a training step runs: their source is part of the step store's key.
SOURCE_PACKAGES = ("jaxtune", "pallas_kernels", "converters")


@functools.cache
def _environment() -> str:
  """What, besides the step's own inputs, decides the program XLA makes: this package's
  source, the versions, the backend and devices, JAX's settings and XLA's flags."""
  import flax
  import jaxlib
  import optax

  source = hashlib.sha256()
  for package in SOURCE_PACKAGES:
    spec = importlib.util.find_spec(package)
    for place in spec.submodule_search_locations if spec is not None else ():
      for path in sorted(Path(place).rglob("*.py")):
        source.update(path.relative_to(place).as_posix().encode() + b"\0" + path.read_bytes())
  device = jax.devices()[0]
  flags = sorted(
    (k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "NVIDIA_", "CUDA_"))
  )
  settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
  return repr(
    (
      source.hexdigest(),
      platform.python_version(),
      jax.__version__,
      jaxlib.__version__,
      flax.__version__,
      optax.__version__,
      device.platform,
      device.client.platform_version,
      [d.device_kind for d in jax.devices()],
      flags,
      settings,
    )
  )


class _DamagedCacheEntries:
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


def _count_cache_hit(event: str, **kwargs) -> None:
  global _cache_hits
  if event == "/jax/compilation_cache/cache_hits":
    _cache_hits += 1


@functools.cache
def _listen_for_cache_hits() -> None:
  jax.monitoring.register_event_listener(_count_cache_hit)


CACHE_GIB = 16  # the cache's size limit
CACHE_VAR = "JAXTUNE_COMPILE_CACHE"  # a directory for the compiled programs; "" turns it off


def use_compile_cache(enabled: bool = True) -> Path | None:
  """Turn on JAX's persistent compilation cache for the command lines (a second run, a
  resume, an export or a generate of the same shapes skips compiling); returns its directory.

  The directory: ``$JAXTUNE_COMPILE_CACHE``, else JAX's own setting
  (``JAX_COMPILATION_CACHE_DIR``) when the user made one, else ``~/.cache/jaxtune/xla``
  (``$XDG_CACHE_HOME``). Runs may share it: with a size limit (CACHE_GIB, least recently used
  entries evicted; ``JAX_COMPILATION_CACHE_MAX_SIZE`` overrides) jax 0.11.2 reads and writes
  entries under a file lock, where without one it writes in place, unguarded. An entry cut
  short (a run killed while writing it) is skipped with a warning and compiled anew.
  ``enabled=False`` (``--no-compile-cache``) or an empty ``$JAXTUNE_COMPILE_CACHE`` leave the
  cache off; so does a directory that is not this user's alone (``private_problem``: another
  user's, or writable by others), with one line: a shared cache would run others' programs.
  With the cache on, the training step chosen is also kept whole in its directory
  ``jaxtune-steps`` (``_StepStore``; ``JAXTUNE_STEP_STORE=0`` keeps the cache only).
  """
  global _store_dir
  _store_dir = None
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
    _store_dir = Path(place) / STORE_NAME
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
    jax.config.update("jax_compilation_cache_max_size", CACHE_GIB * GIB)
  # Every program, not only those of a second or more (JAX's default): the small ones (LoRA
  # and optimizer set-up, placement) cost an 8B run's first step 0.9 s on an H100.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return Path(place)

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
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend

from jaxtune.errors import UserError, size_text
from jaxtune.parallel.runtime import Plan, Runtime
from jaxtune.training import compile_cache, step_store

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
class MemoryPlan:
  """The chosen setting, what it plans to use, and what was tried before it: recorded in the
  run's ``Plan`` (jaxtune.parallel.runtime) by ``choose``."""

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
  plan: Plan | Runtime,
  budget: tuple[int, str],
  logits_bytes: int = 0,
  floor: Callable[[Runtime], int] | None = None,
  identity: str | None = None,
) -> tuple[Any, MemoryPlan]:
  """(compiled step, memory plan): the first of the candidates that resolve listed
  (``plan.runtime.candidates``) whose compiled plan fits ``budget``, recorded in ``plan``
  (``Plan.record``; a ``Runtime`` alone stands for a plan of it). ``build(runtime)`` returns the
  jitted step, lowered and compiled here with ``args`` (the real first arguments, so the program's
  layouts are the run's). ``logits_bytes``: the float32 logits of one micro-batch on one device; a
  loss-chunked candidate is not compiled when its unchunked twin would not fit even without 4
  times that (the logits, their gradient and the softmax's temporaries are what chunking saves),
  and a DOMINATED_BY setting is not compiled once the setting that dominates it was refused.
  ``floor(runtime)``: a floor of that candidate's plan found without compiling
  (``floor_bytes``); a candidate whose floor misses the budget is not compiled, nor its
  layers unrolled (also for a forced setting) where UNROLLED_GROWTH times the floor misses.
  Not traced against host memory (a CPU backend without --memory-limit): there the first
  candidate nearly always fits, and the trace cost a second per run (CPU tests: ~40 runs).

  ``identity``: what decides the program ``build`` makes besides ``args``' shapes and
  placement, ``runtime`` and ``budget`` (the model's graphdef, the run's settings that reach
  the program, e.g. the schedule's kind, the objective), as text: with it, and the step
  store on (``compile_cache.use_compile_cache``), the chosen step is kept whole, and a later
  process with the same key reads it back without tracing, lowering or choosing
  (``step_store.StepStore``).

  Raises a ``UserError`` naming the leanest plan and the levers when none fits.
  """
  plan = plan if isinstance(plan, Plan) else Plan(plan)
  runtime = plan.runtime
  t0 = time.perf_counter()
  store = step_store.StepStore.open(identity, args, runtime, budget, logits_bytes)
  if store is not None:
    found = store.load(args)
    if found is not None:
      compiled, (remat, loss_chunk, scan_layers, kept, planned, limit, source, rejected) = found
      rt = runtime.replace(
        remat=remat, loss_chunk=loss_chunk, scan_layers=scan_layers, kept_layers=kept,
        candidates=(), try_unrolled=False, keep_up_to=0,
      )  # fmt: skip
      took = time.perf_counter() - t0
      chosen = MemoryPlan(rt, planned, limit, source, rejected, took, 0, stored=True)
      plan.record(chosen)
      return compiled, chosen
  compiled, chosen = _choose(build, args, runtime, budget, logits_bytes, floor)
  if store is not None:
    store.save(compiled, chosen)
  plan.record(chosen)
  return compiled, chosen


def _choose(build, args, runtime, budget, logits_bytes, floor) -> tuple[Any, MemoryPlan]:
  candidates = runtime.candidates or ((runtime.remat, runtime.loss_chunk),)
  choosing = len(candidates) > 1
  limit, source = budget
  rejected: list[tuple[str, int, bool]] = []
  compile_cache.listen_for_cache_hits()
  t0, hits = time.perf_counter(), compile_cache.cache_hits()
  with compile_cache.DamagedCacheEntries():
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
        chosen = MemoryPlan(
          rt,
          planned or 0,
          limit if choosing else None,
          source,
          tuple(rejected),
          time.perf_counter() - t0,
          compile_cache.cache_hits() - hits,
        )
        return compiled, chosen
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


def _compile(build, rt: Runtime, args) -> Any:
  with scan_outputs_unwritten(enabled=rt.mesh is None):  # one device: see its docstring
    lowered = build(rt).lower(*args)
  compile_cache.listen_for_cache_hits()
  hits = compile_cache.cache_hits()
  compiled = lowered.compile()
  if compile_cache.cache_hits() > hits:
    step_store.FROM_CACHE.add(compiled)
  return compiled

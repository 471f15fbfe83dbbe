"""Measuring helpers the benchmarks share: the reference matmul rate, host and device memory."""

import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
  """bf16 n x n x n matmul rate (median of ``reps`` calls), the rate utilisation is quoted
  against."""
  keys = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(keys[0], (n, n), jnp.bfloat16)
  b = jax.random.normal(keys[1], (n, n), jnp.bfloat16)
  f = jax.jit(jnp.dot)
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / statistics.median(times) / 1e12


def wall_ms(f, *args, reps: int = 6) -> float:
  """Median wall-clock milliseconds of ``f(*args)`` over ``reps`` calls after one warm-up
  (compilation), each waited for on the device."""
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times) * 1e3


def _status_kib(key: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(key + ":"):
      return int(line.split()[1])
  raise KeyError(key)


def reset_host_peak() -> int:
  """Reset VmHWM to the current RSS (Linux) and return that RSS in bytes."""
  Path("/proc/self/clear_refs").write_text("5")
  return _status_kib("VmRSS") * 1024


def host_peak() -> int:
  """The process's peak resident memory (VmHWM) since the last reset, in bytes."""
  return _status_kib("VmHWM") * 1024


def step_gib(compiled) -> float:
  """XLA's plan for one compiled step: arguments, outputs and temporaries, donated buffers
  once (GiB; NaN where the backend gives no memory analysis)."""
  m = compiled.memory_analysis()
  if m is None:
    return float("nan")
  total = (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )
  return total / 2**30

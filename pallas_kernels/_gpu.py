"""What every kernel's dispatcher asks: is this a Hopper GPU, and how to interpret on CPU.

Mosaic GPU kernels (``plgpu.kernel``) run on NVIDIA GPUs of compute capability 9.0. On any
other backend the ops fall back to XLA, and tests run the kernels in Mosaic GPU's interpret
mode, whose parameters class is private in jax 0.11.2: it is imported here and nowhere else,
as is the warp-specialized pipeline's register split (``compute_registers``).
"""

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams


@functools.cache
def on_hopper() -> bool:
  """True when JAX's default device is an NVIDIA GPU of compute capability 9.0."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  return str(getattr(device, "compute_capability", "")) == "9.0"


def interpret_params() -> "InterpretGPUParams":
  """Mosaic GPU's CPU interpreter settings, for tests (runs TMA copies and wgmma on CPU)."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415

  return InterpretGPUParams()


# Registers per thread of each compute warpgroup when a block has four of them (and the
# pipeline's memory warpgroup): 4 x 128 x 96 + 128 x 40 = 54,272 of the 640 x 96 = 61,440 a
# block of 640 threads is launched with.
FOUR_WARPGROUP_REGISTERS = 96


@functools.cache
def four_warpgroups_supported() -> bool:
  """Whether ``compute_registers`` can correct the pipeline's register split (the private
  function it replaces exists in this jax)."""
  try:
    from jax._src.pallas.mosaic_gpu import pipeline  # noqa: PLC0415
  except ImportError:
    return False
  return callable(getattr(pipeline, "_compute_registers", None))


_PATCH_LOCK = threading.RLock()  # one patch at a time; a trace nested in a trace is fine


@contextlib.contextmanager
def compute_registers(num_compute_wgs: int) -> Iterator[None]:
  """While a kernel is traced: Mosaic GPU's warp-specialized pipeline (jax 0.11.2) raises each
  compute warpgroup to floor8((512 - memory registers) / warpgroups) registers by setmaxnreg.
  With four compute warpgroups that is 112, more than the block was launched with (640
  threads x 96), so the increase never completes and the block hangs on the GPU (measured on
  an H100: no result in 90 s; with 96 it runs, experiments/RESULTS.md). Four compute
  warpgroups get ``FOUR_WARPGROUP_REGISTERS`` instead; other counts keep the pipeline's.
  Used inside the kernel's body around the pipeline, so that every trace of the body (a
  vmap of the kernel traces it again, later) is covered."""
  if num_compute_wgs != 4:
    yield
    return
  from jax._src.pallas.mosaic_gpu import pipeline  # noqa: PLC0415

  with _PATCH_LOCK:
    original = pipeline._compute_registers

    def split(memory_registers: int, wgs: int) -> int:
      return FOUR_WARPGROUP_REGISTERS if wgs == 4 else original(memory_registers, wgs)

    pipeline._compute_registers = split
    try:
      yield
    finally:
      pipeline._compute_registers = original

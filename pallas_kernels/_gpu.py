"""What every kernel's dispatcher asks: is this a Hopper GPU, and how to interpret on CPU.

Mosaic GPU kernels (``plgpu.kernel``) run on NVIDIA GPUs of compute capability 9.0. On any
other backend the ops fall back to XLA, and tests run the kernels in Mosaic GPU's interpret
mode, whose parameters class is private in jax 0.11.2: it is imported here and nowhere else.
"""

import functools
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

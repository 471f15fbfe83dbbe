"""Flash attention for Hopper (Mosaic GPU): forward and backward kernels, reference, the op."""

from pallas_kernels.flash_attention.ops import (
  IMPLEMENTATIONS,
  cudnn_supports,
  flash_attention,
  mosaic_supports,
)
from pallas_kernels.flash_attention.reference import attention as reference_attention

__all__ = [
  "IMPLEMENTATIONS",
  "cudnn_supports",
  "flash_attention",
  "mosaic_supports",
  "reference_attention",
]

"""Flash attention for Hopper (Mosaic GPU): forward and backward kernels, reference, dispatcher."""

from pallas_kernels.flash_attention.ops import IMPLEMENTATIONS, flash_attention
from pallas_kernels.flash_attention.reference import attention as reference_attention

__all__ = ["IMPLEMENTATIONS", "flash_attention", "reference_attention"]

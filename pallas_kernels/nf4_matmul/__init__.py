"""Fused NF4 dequant-matmul: Mosaic GPU kernels (kernel.py) and their table lookups
(lookups.py), the differentiable op (ops.py), pure-jnp twins (reference.py)."""

from pallas_kernels.nf4_matmul.ops import (
  IMPLS,
  kernel_pays,
  kernel_scales,
  nf4_matmul,
  prepared_matmul,
  training_operands,
  word_codes,
)
from pallas_kernels.nf4_matmul.reference import nf4_matmul_reference

__all__ = [
  "IMPLS",
  "kernel_pays",
  "kernel_scales",
  "nf4_matmul",
  "nf4_matmul_reference",
  "prepared_matmul",
  "training_operands",
  "word_codes",
]

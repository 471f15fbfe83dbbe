"""Fused NF4 dequant-matmul: Mosaic GPU kernels (kernel.py's forward, kernel_backward.py, what
they share in kernel_common.py) and their table lookups (lookups.py), their operands
(operands.py), the differentiable op (ops.py) and its launch configurations (configs.py),
pure-jnp twins (reference.py)."""

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

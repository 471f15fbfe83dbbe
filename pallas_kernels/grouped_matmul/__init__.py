"""Grouped matmul for mixtures of experts: rows sorted by group (expert), each group's rows
times that group's weight. One dispatch function (ops.py) over XLA's ``ragged_dot`` and a
pure-jnp reference (reference.py); the GPU-kernel issue for the new families adds a Pallas
kernel behind the same function."""

from pallas_kernels.grouped_matmul.ops import IMPLS, grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference, row_groups

__all__ = ["IMPLS", "grouped_matmul", "grouped_matmul_reference", "row_groups"]

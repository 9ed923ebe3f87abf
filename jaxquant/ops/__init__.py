"""Differentiable user ops: quantized GEMM layers and the GEMM dispatch point."""

from jaxquant.ops._dense import dense
from jaxquant.ops._grouped_dense import grouped_dense
from jaxquant.ops._weight_gather import WeightGather

__all__ = ["dense", "grouped_dense", "WeightGather"]

"""Differentiable user ops: quantized GEMM layers and the GEMM dispatch point."""

from jaxquant.ops.dense import dense
from jaxquant.ops.grouped_dense import grouped_dense
from jaxquant.ops.weight_gather import WeightGather

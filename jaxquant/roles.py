"""QuantizerRole: which tensor of which GEMM module a quantizer is asked for."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = [
  "GROUPED_LINEAR",
  "LINEAR",
  "QuantizerRole",
  "TensorType",
  "TENSOR_TYPES",
  "gemm_roles",
]

# The module types of jaxquant's GEMM modules: a recipe maps (module type, name) to quantizers.
LINEAR = "linear"  # a dense GEMM: Dense, DenseGeneral, Einsum, Linear, a routed contraction
GROUPED_LINEAR = "grouped_linear"  # one GEMM per group of rows (MoE experts)

TensorType = Literal["input", "weight", "grad_output"]
TENSOR_TYPES: tuple[TensorType, ...] = ("input", "weight", "grad_output")


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
  """A GEMM module emits exactly one role per tensor type.

  Attributes:
    module_type: "linear", "grouped_linear", ... (what kind of GEMM module).
    tensor_type: "input", "weight" or "grad_output".
    name: the module path, e.g. "decoder/layer_3/mlp/wi".
  """

  module_type: str
  tensor_type: TensorType
  name: str = ""

  def __post_init__(self):
    if self.tensor_type not in TENSOR_TYPES:
      raise ValueError(
        f"QuantizerRole.tensor_type must be one of {TENSOR_TYPES}, got {self.tensor_type!r}"
      )


def gemm_roles(module_type: str, name: str) -> dict[TensorType, QuantizerRole]:
  """The three roles of one GEMM module."""
  return {t: QuantizerRole(module_type, t, name) for t in TENSOR_TYPES}

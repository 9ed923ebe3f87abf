"""`swap_report`: every contraction a quantized model makes, and how each one runs.

It traces one call of the model (shapes only: `jax.eval_shape` / `nnx.eval_shape`, so
nothing is computed and no state changes) and lists, per contraction met: the module
path, what the code called, the operand shapes (the weight's last), the role and each
tensor type's quantizer, or why it stays in high precision (the recipe maps it to None;
the shape does not fit the format, under `on_unfit="high_precision"`; not a weight GEMM:
no operand is a param, e.g. attention scores and probabilities times values).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
from flax import nnx

from jaxquant.flax import _session as sessions
from jaxquant.flax._rng import QUANT_RNG
from jaxquant.flax._session import Row
from jaxquant.flax.swap._linen import QuantizedModel
from jaxquant.flax.swap._nnx import PATH_ATTR
from jaxquant.quantizers import Quantizer
from jaxquant.roles import TENSOR_TYPES

_COLUMNS = ("path", "call", "shapes", "role", "input", "weight", "grad_output", "status")


def _name(q: Optional[Quantizer]) -> str:
  return "-" if q is None else repr(q)


@dataclasses.dataclass(frozen=True)
class SwapReport:
  """The rows of one traced call; `str()` is a table."""

  rows: tuple[Row, ...]

  @property
  def quantized(self) -> tuple[Row, ...]:
    return tuple(r for r in self.rows if r.status == sessions.QUANTIZED)

  @property
  def high_precision(self) -> tuple[Row, ...]:
    return tuple(r for r in self.rows if r.status != sessions.QUANTIZED)

  def _cells(self, row: Row) -> tuple[str, ...]:
    quantizers = row.quantizers or {}
    return (
      row.path or "-",
      row.call,
      " x ".join(str(tuple(s)) for s in row.shapes),
      row.role or "-",
      *(_name(quantizers.get(t)) for t in TENSOR_TYPES),
      row.status,
    )

  def __str__(self) -> str:
    table = [_COLUMNS] + [self._cells(r) for r in self.rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
    lines = [
      "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def swap_report(model: Any, *args, **kwargs) -> SwapReport:
  """Every contraction one call of a quantized model makes (see the module docstring).

  Linen: `swap_report(quantized_model, variables, *args, **kwargs)`, the model as
  `quantize_model` returned it and the variables of its `init`.
  NNX: `swap_report(quantized_model, *args, **kwargs)`.
  """
  rows: list[Row] = []
  record = sessions.collecting(rows)
  if isinstance(model, nn.Module):
    if not isinstance(model, QuantizedModel):
      raise TypeError(
        "swap_report: pass the model that jaxquant.flax.quantize_model returned, "
        f"got a {type(model).__name__}"
      )
    variables, *args = args
    apply = lambda v, *a: model.apply(
      v, *a, rngs={QUANT_RNG: jax.random.key(0)}, mutable=True, **kwargs
    )
    with record:
      jax.eval_shape(apply, variables, *args)
  else:
    if not hasattr(model, PATH_ATTR):
      raise TypeError("swap_report: pass an NNX model that jaxquant.flax.quantize_model quantized")
    with record:
      nnx.eval_shape(lambda m, *a: m(*a, **kwargs), model, *args)
  return SwapReport(tuple(rows))

"""Which param a contraction operand is: the param itself, or a cast or view of it.

Real layers rarely contract a param as they read it: they cast it
(`jnp.asarray(kernel, dtype)`, `kernel.astype(...)`), transpose it (`table.T`), reshape
it, or constrain its sharding. So an operand is matched to a param by identity first,
then by walking back from the operand through the operations that produced it, as long
as each one only changes dtype, layout or sharding (never which values it holds), to a
param.

JAX has no public query for "which operation produced this traced value". The walk
reads what its tracers record while tracing (`parent`: the traced equation, its
primitive and `in_tracers`; `primal` / `val`: the value inside a JVP, linearize or
batching tracer), fields that JAX 0.10 to 0.12 share; where they are missing, only
identity matches. Concrete (eager) values record nothing: eagerly, an operand matches a
weight-shaped param (rank >= 2) whose values, cast to the operand's dtype, it holds in
the same order or transposed (`.T`). An operand that matches no param is an activation,
and its contraction is listed by the swap report as not a weight GEMM: a mismatch is
visible, never silent.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, TypeVar

import jax
import numpy as np

T = TypeVar("T")

# Primitives whose output holds exactly the values of their one input.
_VALUE_PRESERVING = frozenset(
  {
    "convert_element_type",
    "transpose",
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "sharding_constraint",
    "copy",
    "copy_p",
    "device_put",
    "reshard",
    "mesh_cast",
  }
)


def _inner(value: Any) -> Any:
  """The value a JVP / linearize (`primal`) or batching (`val`) tracer carries."""
  while isinstance(value, jax.core.Tracer):
    for attr in ("primal", "val"):
      inner = getattr(value, attr, None)
      if isinstance(inner, jax.core.Tracer) or (attr == "primal" and hasattr(inner, "shape")):
        value = inner
        break
    else:
      return value
  return value


def _producer_input(value: Any) -> Optional[Any]:
  """The input of the value-preserving equation that produced `value`, if any."""
  eqn = getattr(value, "parent", None)
  inputs = getattr(eqn, "in_tracers", None)
  primitive = getattr(getattr(eqn, "primitive", None), "name", None)
  if primitive not in _VALUE_PRESERVING or inputs is None or len(inputs) != 1:
    return None
  (source,) = inputs
  if math.prod(getattr(source, "shape", (-1,))) != math.prod(value.shape):
    return None  # a broadcast that repeats values
  return source


def _holds_values_of(operand: jax.Array, param: Any) -> bool:
  """Eagerly: whether `operand` is `param` cast, reshaped, or transposed (`.T`)."""
  if isinstance(param, jax.core.Tracer) or np.ndim(param) < 2 or np.size(param) != np.size(operand):
    return False
  cast = np.asarray(param).astype(operand.dtype)
  values = np.asarray(operand)
  return bool(
    np.array_equal(values.ravel(), cast.ravel()) or np.array_equal(values.ravel(), cast.T.ravel())
  )


def find(operand: Any, params: Mapping[T, Any]) -> Optional[T]:
  """The label of the param `operand` is (or was cast / viewed from), else None.

  `params`: {label: value} of the params the model's code can read in this trace.
  """
  ids = {id(_inner(v)): label for label, v in params.items()}
  value = _inner(operand)
  while value is not None:
    if id(value) in ids:
      return ids[id(value)]
    value = _producer_input(value)
    value = None if value is None else _inner(value)
  if isinstance(operand, jax.Array) and not isinstance(operand, jax.core.Tracer):
    return next((label for label, v in params.items() if _holds_values_of(operand, v)), None)
  return None

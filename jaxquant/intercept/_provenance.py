"""Which param a contraction operand is: the param itself, a cast or view of it, or the
param transformed elementwise by its module's other params and constants.

Real layers rarely contract a param as they read it: they cast it
(`jnp.asarray(kernel, dtype)`, `kernel.astype(...)`), transpose it (`table.T`), reshape
it, constrain its sharding, or scale it (Gemma 4's `w * w_scale`, a per-channel
`w * (1 + scale)`, a constant `w * 0.5`). So an operand is matched to a param by
identity first, then by walking back from the operand through the operations that
produced it:

- through operations that only change dtype, layout or sharding (never which values it
  holds), to a param: the operand is that param;
- through any operations, to its module's own params and constants only (literals, the
  trace's constants, values computed from no input; an array that the traced function
  closes over is one of its constants): the operand is a weight computed from params.
  It is the weight of the param that carries its shape: the one param of its size
  reached through elementwise operations alone (`_ELEMENTWISE`, and the value-preserving
  ones), each operand element computed from that param's element at its place (`w`, not
  the broadcast `w_scale`). Its GEMM quantizes the values contracted (the scaled
  weight), under that param's role.

The walk never takes a value that is not its module's params or constants (an input of
the trace: the activations, or another module's param) for part of a weight: an operand
that depends on one is an activation (`x * w`, then contracted, is no weight GEMM; so is
a normed activation `x * scale`). Where a param of the operand's shape was reached
elementwise all the same, the operand looks like a weight that is not matched, and
`trace_operand` says why (`Provenance.unresolved`): it mixes in values that are not
params (the walk cannot tell an activation from another module's param), two params
carry its shape, none does (a param-only operand sliced, gathered or contracted from
params), or its computation is longer than the walk follows (`_MAX_VALUES`).

JAX has no public query for "which operation produced this traced value". The walk
reads what its tracers record while tracing: the traced equation (a jit tracer's
`parent`, a partial-evaluation tracer's `recipe`: its primitive, `in_tracers`, and the
jaxpr a jitted or custom-JVP function calls); the value inside a JVP, linearize or
batching tracer (`primal` / `val`); a traced constant (a `Literal`, a variable of its
trace's constants, a partial-evaluation tracer's known value or constant recipe), which
may be a tracer of the enclosing trace (a value closed over by `jax.checkpoint`),
followed there. JAX 0.10 to 0.12 share these fields; where they are missing, a value
counts as an input (never as a param or constant), so nothing is matched that should
not be. Concrete (eager) values record nothing: eagerly, an operand matches a
weight-shaped param (rank >= 2) whose values, cast to the operand's dtype, it holds in
the same order or transposed (`.T`). An eager operand of a param's shape holding other
values (a scaled weight, or an activation of that shape) is unresolved: only tracing the
call (`jax.jit`, `nnx.jit`) tells the two apart. An operand that matches no param is an
activation, and its contraction is listed by the swap report as not a weight GEMM: a
mismatch is visible, never silent.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Generic, Mapping, Optional, TypeVar

import jax
import numpy as np
from jax.extend.core import Literal

T = TypeVar("T")

# Primitives whose output holds exactly the values of their one input (a cast, a view, a
# sharding); `_report` follows params through them too.
VALUE_PRESERVING = frozenset(
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

# Primitives each of whose output elements is computed from the elements at its place in
# their (broadcast) inputs: what scales, shifts or clips a weight.
_ELEMENTWISE = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "neg",
    "max",
    "min",
    "pow",
    "integer_pow",
    "square",
    "sqrt",
    "rsqrt",
    "cbrt",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "abs",
    "sign",
    "tanh",
    "logistic",
    "erf",
    "floor",
    "ceil",
    "round",
    "clamp",
    "select_n",
  }
)

# How many values the walk over an operand's computation visits at most: a weight's
# transformation is a few operations; an activation's history is the model so far.
_MAX_VALUES = 64


@dataclasses.dataclass(frozen=True)
class Provenance(Generic[T]):
  """What the walk found for an operand: the label of the param it is (its weight), or
  None; and, for an operand not matched that looks like a weight, why (else None)."""

  label: Optional[T] = None
  unresolved: Optional[str] = None


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


def _equation(value: Any) -> Any:
  """The traced equation that produced `value`, if any: a jit trace's tracer records it as
  its `parent`, a partial-evaluation trace's (the first pass of `nn.scan`) as its
  `recipe`; either has a `primitive` and `in_tracers`."""
  eqn = getattr(value, "parent", None)
  if eqn is None:
    recipe = getattr(value, "recipe", None)
    eqn = recipe if hasattr(recipe, "primitive") and hasattr(recipe, "in_tracers") else None
  return eqn


def _producer_input(value: Any) -> Optional[Any]:
  """The input of the value-preserving equation that produced `value`, if any."""
  eqn = _equation(value)
  inputs = getattr(eqn, "in_tracers", None)
  primitive = getattr(getattr(eqn, "primitive", None), "name", None)
  if primitive not in VALUE_PRESERVING or inputs is None or len(inputs) != 1:
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


_CONSTANT = object()  # what `_traced_constant` gives for a constant of the trace


def _traced_constant(value: jax.core.Tracer) -> Any:
  """For a tracer that no equation produced: `_CONSTANT` for a literal or a concrete
  constant of its trace; the enclosing trace's tracer that a constant of an inner trace
  (`jax.checkpoint`, a scan body) stands for; None for anything else (an input)."""
  recipe = getattr(value, "recipe", None)  # a partial-evaluation tracer's
  pval = getattr(value, "pval", None)
  if hasattr(recipe, "val") or (recipe is None and pval is not None and pval.is_known()):
    constant = recipe.val if recipe is not None else pval.get_known()
    return constant if isinstance(constant, jax.core.Tracer) else _CONSTANT
  atom = getattr(value, "val", None)
  if isinstance(atom, Literal):
    return _CONSTANT
  frame = getattr(getattr(value, "_trace", None), "frame", None)
  constants = getattr(frame, "constvar_to_val", None)
  if atom is None or not isinstance(constants, Mapping) or atom not in constants:
    return None
  constant = constants[atom]
  return constant if isinstance(constant, jax.core.Tracer) else _CONSTANT


@dataclasses.dataclass
class _Sources:
  """What an operand was computed from: the labels of the params reached, {label: size}
  of those reached through elementwise operations alone (each operand element computed
  from the param's element at its place, or broadcast), whether it depends on anything
  else, and whether the walk stopped before reaching every source."""

  params: set = dataclasses.field(default_factory=set)
  elementwise: dict = dataclasses.field(default_factory=dict)
  other_inputs: bool = False
  truncated: bool = False


def _sources(operand: Any, ids: Mapping[int, Any]) -> _Sources:
  """Walks back (breadth first) from `operand` through every equation that produced it."""
  found = _Sources()
  queue, seen = collections.deque([(_inner(operand), True)]), set()
  while queue:
    value, elementwise = queue.popleft()
    if (id(value), elementwise) in seen:
      continue
    seen.add((id(value), elementwise))
    if len(seen) > _MAX_VALUES:
      found.truncated = True
      break
    label = ids.get(id(value))
    if label is not None:
      found.params.add(label)
      if elementwise:
        found.elementwise[label] = math.prod(np.shape(value))
      continue
    if not isinstance(value, jax.core.Tracer):
      continue  # a concrete value: a constant
    eqn = _equation(value)
    inputs = getattr(eqn, "in_tracers", None)
    if eqn is None:
      constant = _traced_constant(value)
      if constant is None:
        found.other_inputs = True
      elif constant is not _CONSTANT:
        queue.append((_inner(constant), elementwise))
    elif inputs is None:
      found.other_inputs = True  # an equation the walk cannot read
    else:  # an equation without inputs (`iota`) computes a constant: nothing to queue
      along = elementwise and _is_elementwise(eqn)
      queue.extend((_inner(v), along) for v in inputs)
  return found


def _is_elementwise(eqn: Any, depth: int = 0) -> bool:
  """Whether `eqn` is elementwise: its primitive is, or it calls a jaxpr (a jitted
  function such as `jnp.where` or `jnp.clip`, a custom-JVP one such as `jax.nn.relu`)
  whose equations all are."""
  primitive = getattr(getattr(eqn, "primitive", None), "name", None)
  if primitive in _ELEMENTWISE or primitive in VALUE_PRESERVING:
    return True
  params = getattr(eqn, "params", None) or {}
  called = params.get("jaxpr", params.get("call_jaxpr"))
  called = getattr(called, "jaxpr", called)  # a ClosedJaxpr's jaxpr
  eqns = getattr(called, "eqns", None)
  return depth < 4 and eqns is not None and all(_is_elementwise(e, depth + 1) for e in eqns)


def _names(labels) -> str:
  return " and ".join(repr(label) for label in labels)


def _traced(operand: Any, ids: Mapping[int, Any]) -> Provenance:
  """The verdict of the walk over a traced operand's computation (module docstring)."""
  found = _sources(operand, ids)
  size = math.prod(np.shape(operand))
  carriers = [label for label, n in found.elementwise.items() if n == size]
  if not found.params or ((found.other_inputs or found.truncated) and not carriers):
    return Provenance()  # e.g. activations scaled by a param (a norm's), or a GEMM's output
  if found.other_inputs:
    return Provenance(
      unresolved=f"computed from param {_names(carriers)} and values that are not its "
      "module's params or constants (an activation, or another module's param)"
    )
  if found.truncated:
    return Provenance(
      unresolved=f"computed from param {_names(carriers)} through more operations than "
      f"the swap-in follows ({_MAX_VALUES} values)"
    )
  if len(carriers) == 1:
    return Provenance(label=carriers[0])
  if carriers:
    return Provenance(
      unresolved=f"computed elementwise from params {_names(carriers)}, each of its "
      "shape: which one is the weight is ambiguous"
    )
  return Provenance(
    unresolved=f"computed from params {_names(sorted(found.params, key=str))}, none of "
    "them of its size, elementwise"
  )


def _eager(operand: jax.Array, params: Mapping[T, Any]) -> Provenance[T]:
  """Eagerly: the param whose values the operand holds; unresolved, one of its shape."""
  label = next((label for label, v in params.items() if _holds_values_of(operand, v)), None)
  if label is not None:
    return Provenance(label=label)
  shaped = [
    label
    for label, v in params.items()
    if np.ndim(v) >= 2 and np.shape(operand) in (np.shape(v), np.shape(v)[::-1])
  ]
  if not shaped:
    return Provenance()
  return Provenance(
    unresolved=f"eager: it has the shape of param {_names(shaped)} but other values "
    "(a transformed weight, or an activation of that shape), and eager values record no "
    "history; call the model under jax.jit / nnx.jit to trace it"
  )


def trace_operand(operand: Any, params: Mapping[T, Any]) -> Provenance[T]:
  """Which of `params` the operand is, or why a weight-like operand is none of them.

  `params`: {label: value} of the params the model's code can read in this trace (one
  module's own).
  """
  if not params:
    return Provenance()
  ids = {id(_inner(v)): label for label, v in params.items()}
  value = _inner(operand)
  while value is not None:
    if id(value) in ids:
      return Provenance(label=ids[id(value)])
    value = _producer_input(value)
    value = None if value is None else _inner(value)
  if isinstance(operand, jax.Array) and not isinstance(operand, jax.core.Tracer):
    return _eager(operand, params)
  if not isinstance(_inner(operand), jax.core.Tracer):
    return Provenance()  # concrete values inside a transform (eager grad): as before
  return _traced(operand, ids)


def find(operand: Any, params: Mapping[T, Any]) -> Optional[T]:
  """The label of the param `operand` is (or was cast / viewed / transformed from by its
  module's params and constants), else None.

  `params`: {label: value} of the params the model's code can read in this trace.
  """
  return trace_operand(operand, params).label

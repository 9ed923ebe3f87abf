"""A swap report: every contraction a quantized model or function makes, and how each one
runs (`SwapReport`, its rows), and the contractions of params the interception never met
(`unreached_rows`).

Each integration's `swap_report` traces one call of the model or function (`jax.make_jaxpr`, so
nothing is computed and no state changes) and lists, per contraction met: the module path, what the
code called, the operand shapes (the weight's last), the role and each tensor type's quantizer, or
why it stays in high precision (the recipe maps it to None; a tiny GEMM the recipe keeps there; the
shape does not fit the format, under `on_unfit="high_precision"`; not a weight GEMM: no operand is a
param, e.g. attention scores and probabilities times values).

Then it lists what the interception never met: every contraction in the traced
computation with an operand that holds a param's values (the param, or a cast or view of
it, followed into the functions the computation calls) outside the name scope in which
the interception and the layers compute the contractions of params they met
(`_session.PARAM_CONTRACTION_SCOPE`). A GEMM inside a function the model's code wrapped in
`jax.jit` is one: within its trace the weight is the function's own argument, traceable
to no param, and its trace may even be cached from a call before quantization, so the
interception never sees it. Such a GEMM runs as written, and its row says so ("high
precision: inside a jitted function 'helper' ..."); its role column is the param's path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from jaxquant.intercept import _session as sessions
from jaxquant.intercept._provenance import VALUE_PRESERVING
from jaxquant.intercept._session import Row
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


# Primitives that contract two arrays; an operand reached from a param through
# `VALUE_PRESERVING` ones holds the param's values, as `_provenance` reads it too.
_CONTRACTIONS = frozenset({"dot_general", "ragged_dot", "ragged_dot_general"})
_FUNCTION_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def _jaxprs(value) -> list:
  """The jaxprs held by an equation parameter (a jaxpr, a closed one, or a tuple of them)."""
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _jaxprs(v)]
  inner = getattr(value, "jaxpr", value)
  return [inner] if hasattr(inner, "eqns") and hasattr(inner, "invars") else []


def _label(env: dict, var) -> Optional[str]:
  return None if hasattr(var, "val") else env.get(var)  # a Literal holds no param


def _unreached(jaxpr, env: dict, function: Optional[str], met: bool, found: list) -> None:
  """Appends (param path, primitive, shapes, jitted function or None) for each
  contraction of `jaxpr` with an operand holding a param's values (`env`: var -> param
  path) outside the met scope, in `jaxpr` and the jaxprs its equations call."""
  for eqn in jaxpr.eqns:
    inside = met or sessions.PARAM_CONTRACTION_SCOPE in str(eqn.source_info.name_stack)
    labels = [_label(env, v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in VALUE_PRESERVING and len(eqn.invars) == 1 and labels[0]:
      if math.prod(eqn.invars[0].aval.shape) == math.prod(eqn.outvars[0].aval.shape):
        env[eqn.outvars[0]] = labels[0]
    if name in _CONTRACTIONS and not inside and any(labels[:2]):
      weight = 1 if labels[1] else 0
      shapes = tuple(tuple(v.aval.shape) for v in (eqn.invars[1 - weight], eqn.invars[weight]))
      found.append((labels[weight], name, shapes, function))
    inner_function = eqn.params.get("name") if name in _FUNCTION_CALLS else function
    for param in eqn.params.values():
      for inner in _jaxprs(param):
        # Arguments map one to one (a function call, a checkpoint, a scan), or after a
        # leading index (cond's branches); other layouts (a while loop's) map none.
        offset = len(eqn.invars) - len(inner.invars)
        inner_env = {}
        if offset in (0, 1):
          inner_env = {
            v: labels[i + offset] for i, v in enumerate(inner.invars) if labels[i + offset]
          }
        _unreached(inner, inner_env, inner_function, inside, found)


def unreached_rows(traced, param_paths: dict[int, str]) -> list[Row]:
  """Rows of the contractions of params that nothing met (see the module docstring).
  `param_paths`: the param path of each of the traced computation's inputs that is one."""
  env = {traced.jaxpr.invars[i]: path for i, path in param_paths.items()}
  found: list = []
  _unreached(traced.jaxpr, env, None, False, found)
  rows = []
  for path, primitive, shapes, function in found:
    if function is None:
      status = (
        "not reached by the swap-in: a contraction through a function it does not take "
        "over (jnp.tensordot), or of a value it does not trace to the param"
      )
    else:
      status = (
        f"inside a jitted function {function!r}: its operand there is not traceable to a "
        "param (call the function's code unjitted from the model, or quantize it with "
        "jaxquant.ops)"
      )
    module = path.rpartition("/")[0]
    rows.append(Row(module, primitive, shapes, path, None, sessions.high_precision_status(status)))
  return rows

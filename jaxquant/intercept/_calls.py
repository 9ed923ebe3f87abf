"""A routed call (`Call`) and its reading as a two-operand contraction in einsum letters.

`lax.dot_general`, `jnp.einsum`, `jnp.dot` and `jnp.matmul` / `@` all contract axes of
two arrays; written as einsum letters (`lhs,rhs->out`, in the output order the function
itself produces) they share one planner (`jaxquant.intercept._contraction`). A call that
is no two-operand contraction (a scalar product, a three-operand einsum, a broadcast
matmul) gets a reason instead.

`lax.ragged_dot` (and `lax.ragged_dot_general` with its plain dimension numbers) is a
grouped GEMM: `[M, K]` rows in consecutive groups, each times its `[K, N]` of a
`[G, K, N]` rhs; it reads as a `RaggedContraction`, whose rows `ops.grouped_dense`
takes as they are.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Callable, Union

import numpy as np
import opt_einsum

_LETTERS = string.ascii_letters


@dataclasses.dataclass(frozen=True)
class Call:
  """One routed contraction: `kind` in ("dot_general", "einsum", "dot", "matmul",
  "ragged_dot", "ragged_dot_general").

  For "matmul" (also `a @ b`) `args` is (a, b) in mathematical order.
  """

  kind: str
  args: tuple
  kwargs: dict
  original: Callable[..., Any]

  def fallback(self):
    """The call as the model's code made it (never routed again)."""
    return self.original(*self.args, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class Contraction:
  """`out = contract(lhs, rhs)` with axes named by letters; `preferred_element_type` as
  the call gave it (None: the operands' promoted dtype)."""

  lhs: Any
  rhs: Any
  lhs_letters: str
  rhs_letters: str
  out_letters: str
  preferred_element_type: Any = None

  @property
  def equation(self) -> str:
    return f"{self.lhs_letters},{self.rhs_letters}->{self.out_letters}"


@dataclasses.dataclass(frozen=True)
class RaggedContraction:
  """`out[m] = lhs[m] @ rhs[g]` for the rows m of group g: lhs `[M, K]`, rhs `[G, K, N]`,
  `group_sizes` `[G]` (rows past their sum give zeros)."""

  lhs: Any
  rhs: Any
  group_sizes: Any
  preferred_element_type: Any = None
  equation = "mk,gkn->mn"


# `lax.ragged_dot`'s dimension numbers: lhs [M, K] ragged along M, rhs [G, K, N].
_PLAIN_RAGGED = ((((1,), (1,)), ((), ())), (0,), (0,))


def _arg(call: Call, index: int, name: str, default=None):
  if len(call.args) > index:
    return call.args[index]
  return call.kwargs.get(name, default)


def _dot_general(call: Call) -> Union[Contraction, str]:
  lhs, rhs = call.args[0], _arg(call, 1, "rhs")
  (lc, rc), (lb, rb) = _arg(call, 2, "dimension_numbers")
  letters = iter(_LETTERS)
  lhs_l = [None] * np.ndim(lhs)
  rhs_l = [None] * np.ndim(rhs)
  for a, b in list(zip(lb, rb, strict=False)) + list(zip(lc, rc, strict=False)):
    lhs_l[a] = rhs_l[b] = next(letters)
  batch = [lhs_l[a] for a in lb]
  for axes in (lhs_l, rhs_l):
    for i, c in enumerate(axes):
      if c is None:
        axes[i] = next(letters)
  out = (
    batch
    + [c for i, c in enumerate(lhs_l) if i not in lb and i not in lc]
    + [c for i, c in enumerate(rhs_l) if i not in rb and i not in rc]
  )
  return Contraction(
    lhs, rhs, "".join(lhs_l), "".join(rhs_l), "".join(out), _arg(call, 4, "preferred_element_type")
  )


def _einsum(call: Call) -> Union[Contraction, str]:
  subscripts, operands = call.args[0], call.args[1:]
  if not isinstance(subscripts, str):
    return "einsum in the operand-list form"
  if len(operands) != 2:
    return f"einsum of {len(operands)} operands"
  inputs, out, _ = opt_einsum.parser.parse_einsum_input((subscripts.replace(" ", ""), *operands))
  lhs_l, rhs_l = inputs.split(",")
  return Contraction(
    operands[0], operands[1], lhs_l, rhs_l, out, call.kwargs.get("preferred_element_type")
  )


def _dot(call: Call) -> Union[Contraction, str]:
  a, b = call.args[0], _arg(call, 1, "b")
  if np.ndim(a) == 0 or np.ndim(b) == 0:
    return "a product with a scalar"
  a_l = _LETTERS[: np.ndim(a)]
  b_free = _LETTERS[np.ndim(a) : np.ndim(a) + np.ndim(b) - 1]
  if np.ndim(b) == 1:
    b_l, out = a_l[-1], a_l[:-1]
  else:  # a's last axis with b's second-to-last
    b_l = b_free[:-1] + a_l[-1] + b_free[-1]
    out = a_l[:-1] + b_free
  return Contraction(a, b, a_l, b_l, out, call.kwargs.get("preferred_element_type"))


def _matmul(call: Call) -> Union[Contraction, str]:
  a, b = call.args[0], _arg(call, 1, "b")
  if np.ndim(a) == 0 or np.ndim(b) == 0:
    return "a product with a scalar"
  a_shape, b_shape = np.shape(a), np.shape(b)
  a_batch, b_batch = a_shape[:-2], b_shape[:-2]
  if a_batch and b_batch and a_batch != b_batch:
    return f"a broadcast matmul of {a_shape} and {b_shape}"
  batch = _LETTERS[: max(len(a_batch), len(b_batch))]
  m, k, n = _LETTERS[len(batch) : len(batch) + 3]
  a_l = (batch if a_batch else "") + (m + k if len(a_shape) > 1 else k)
  b_l = (batch if b_batch else "") + (k + n if len(b_shape) > 1 else k)
  out = batch + (m if len(a_shape) > 1 else "") + (n if len(b_shape) > 1 else "")
  return Contraction(a, b, a_l, b_l, out, call.kwargs.get("preferred_element_type"))


def _ragged_dot(call: Call) -> Union[RaggedContraction, str]:
  lhs, rhs, group_sizes = call.args[0], _arg(call, 1, "rhs"), _arg(call, 2, "group_sizes")
  general = call.kind == "ragged_dot_general"
  if general:
    numbers = _arg(call, 3, "ragged_dot_dimension_numbers")
    (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
    read = (
      ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))),
      tuple(numbers.lhs_ragged_dimensions),
      tuple(numbers.rhs_group_dimensions),
    )
    if read != _PLAIN_RAGGED:
      return f"a ragged_dot_general with dimension numbers {numbers} (not ragged_dot's)"
  if _arg(call, 6 if general else 5, "group_offset") is not None:
    return "a ragged_dot with a group_offset"
  if np.ndim(lhs) != 2 or np.ndim(rhs) != 3:
    return f"a ragged_dot of shapes {np.shape(lhs)} and {np.shape(rhs)}"
  return RaggedContraction(
    lhs, rhs, group_sizes, _arg(call, 5 if general else 4, "preferred_element_type")
  )


_PARSERS = {
  "dot_general": _dot_general,
  "einsum": _einsum,
  "dot": _dot,
  "matmul": _matmul,
  "ragged_dot": _ragged_dot,
  "ragged_dot_general": _ragged_dot,
}


def contraction(call: Call) -> Union[Contraction, RaggedContraction, str]:
  """The call as a Contraction (a RaggedContraction for a ragged dot), or why it is none
  (a str)."""
  if call.kwargs.get("out_sharding") is not None:
    return "a contraction with an out_sharding"
  return _PARSERS[call.kind](call)


def describe(call: Call, found: Union[Contraction, RaggedContraction, None]) -> str:
  """What the model's code called, for the report: e.g. "einsum 'btd,dnh->btnh'"."""
  if found is None:
    return call.kind
  if call.kind == "einsum":
    return f"einsum {call.args[0].replace(' ', '')!r}"
  return f"{call.kind} {found.equation!r}"


def checkpoint_arguments(options: dict, args: tuple, kwargs: dict) -> tuple[set, list, dict]:
  """Of a call of `jax.checkpoint(fun, **options)`: the positions its `static_argnums` make
  static, and the arguments it traces: the other positional ones, and the keyword ones
  not named by `static_argnames`."""
  numbers = options.get("static_argnums", ())
  numbers = (numbers,) if isinstance(numbers, int) else tuple(numbers)
  static = {n % len(args) for n in numbers} if args else set()
  names = options.get("static_argnames", ())
  names = {names} if isinstance(names, str) else set(names)
  dynamic = [a for i, a in enumerate(args) if i not in static]
  return static, dynamic, {k: v for k, v in kwargs.items() if k not in names}

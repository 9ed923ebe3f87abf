"""jaxquant as a Flax `dot_general` provider and as a MaxText quantization.

- Linen: `dot_general_cls(recipe=None)` is a class to pass as `nn.Dense(...,
  dot_general_cls=...)` / `nn.DenseGeneral(..., dot_general_cls=...)`: the layer
  instantiates it inside its call (a child module) and contracts `(inputs, kernel)`
  through it. The kernel is the weight; roles are named by the calling layer's path.
- NNX: `dot_general(name, recipe=None)` for `nnx.Linear(..., dot_general=...)` /
  `nnx.LinearGeneral`, and `einsum_op(name, recipe=None)` for `nnx.Einsum(...,
  einsum_op=...)`: plain functions (NNX layers do not know their path, hence `name`).
  They hold no state and no RNG, so they take recipes without delayed scaling or
  stochastic rounding (a clear error otherwise); jaxquant's own NNX layers take any.
- MaxText: `MaxTextQuantization(recipe)` has MaxText's quantization protocol:
  `dot_general_cls(mesh_axes=())` returns the Linen class above, `einsum(dtype)` a Linen
  module called as `(equation, lhs, rhs)` with rhs the weight.

The recipe resolves as everywhere: the hook's own, then the model's (when the model runs
under `quantize_model`), then autocast's. With nothing quantized the contraction is
exactly `lax.dot_general` / `jnp.einsum` (bit-identical).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant import recipes
from jaxquant.flax import _routing_pause as routing_pause
from jaxquant.flax import _session as sessions
from jaxquant.flax.swap._calls import Call
from jaxquant.flax.swap._hosts import HookHost, LinenHost, WeightRef
from jaxquant.flax.swap._routed import handle


def _contract(kind: str, args: tuple, kwargs: dict, weight: WeightRef, recipe, original):
  """`original(*args, **kwargs)` with its second operand (rhs) as the weight, per the recipe."""
  rhs = args[1] if kind == "dot_general" else args[2]
  outer = sessions.current()
  session = sessions.Session(
    recipes.resolve(recipe, outer.recipe if outer else None),
    outer.on_unfit if outer else "error",
    find_weight=lambda operand: weight if operand is rhs else None,
    rows=outer.rows if outer else [],
  )
  call = Call(kind, args, kwargs, original)
  with sessions.active(session), routing_pause.paused():
    return handle(call)


class JaxquantDotGeneral(nn.Module):
  """Linen: `lax.dot_general(lhs, rhs, dimension_numbers, ...)` with rhs the weight."""

  recipe: Optional[recipes.CustomRecipe] = None

  def __call__(
    self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
  ):
    caller = "/".join(self.path[:-1])
    weight = WeightRef(caller, "kernel", LinenHost(self))
    return _contract(
      "dot_general",
      (lhs, rhs, dimension_numbers),
      dict(precision=precision, preferred_element_type=preferred_element_type, **kwargs),
      weight,
      self.recipe,
      jax.lax.dot_general,
    )


class JaxquantEinsum(nn.Module):
  """Linen: `jnp.einsum(equation, lhs, rhs, ...)` with rhs the weight (MaxText's
  `quant.einsum()` protocol)."""

  recipe: Optional[recipes.CustomRecipe] = None
  dtype: Any = None  # the rhs is cast to it first, as MaxText's einsum wrappers do

  def __call__(self, equation, lhs, rhs, **kwargs):
    caller = "/".join(self.path[:-1])
    weight = WeightRef(caller, "kernel", LinenHost(self))
    if self.dtype is not None:
      rhs = jnp.asarray(rhs, self.dtype)
    return _contract("einsum", (equation, lhs, rhs), kwargs, weight, self.recipe, jnp.einsum)


def dot_general_cls(recipe: Optional[recipes.CustomRecipe] = None):
  """The class to pass as `dot_general_cls=` to Flax's Linen Dense / DenseGeneral."""
  return functools.partial(JaxquantDotGeneral, recipe=recipe)


def uses_jaxquant_hook(module: nn.Module) -> bool:
  """A stock Linen layer given jaxquant's `dot_general_cls` (it quantizes through it)."""
  cls = getattr(module, "dot_general_cls", None)
  return isinstance(cls, functools.partial) and cls.func in (JaxquantDotGeneral, JaxquantEinsum)


@dataclasses.dataclass(frozen=True)
class dot_general:  # noqa: N801 (used like a function: nnx.Linear(dot_general=...))
  """NNX: a `lax.dot_general` for `nnx.Linear(..., dot_general=jqf.dot_general("mlp/wi"))`."""

  name: str
  recipe: Optional[recipes.CustomRecipe] = None

  def __call__(
    self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
  ):
    weight = WeightRef(self.name, "kernel", HookHost())
    return _contract(
      "dot_general",
      (lhs, rhs, dimension_numbers),
      dict(precision=precision, preferred_element_type=preferred_element_type, **kwargs),
      weight,
      self.recipe,
      jax.lax.dot_general,
    )


@dataclasses.dataclass(frozen=True)
class einsum_op:  # noqa: N801 (used like a function: nnx.Einsum(einsum_op=...))
  """NNX: a `jnp.einsum` for `nnx.Einsum(..., einsum_op=jqf.einsum_op("attn/out"))`."""

  name: str
  recipe: Optional[recipes.CustomRecipe] = None

  def __call__(self, equation, lhs, rhs, **kwargs):
    weight = WeightRef(self.name, "kernel", HookHost())
    return _contract("einsum", (equation, lhs, rhs), kwargs, weight, self.recipe, jnp.einsum)


@dataclasses.dataclass(frozen=True)
class MaxTextQuantization:
  """MaxText's quantization protocol (`quant=` of its layers), backed by a jaxquant recipe."""

  recipe: Optional[recipes.CustomRecipe] = None

  def dot_general_cls(self, mesh_axes: tuple = ()):
    del mesh_axes  # jaxquant's kernels partition per operand sharding (see README)
    return dot_general_cls(self.recipe)

  def einsum(self, dtype: Any = None):
    return JaxquantEinsum(recipe=self.recipe, dtype=dtype)

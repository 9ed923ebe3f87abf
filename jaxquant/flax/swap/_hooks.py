"""jaxquant as a Flax `dot_general` provider and as a MaxText quantization.

- Linen: `dot_general_cls(recipe=None)` is a class to pass as `nn.Dense(...,
  dot_general_cls=...)` / `nn.DenseGeneral(..., dot_general_cls=...)`: the layer
  instantiates it inside its call (a child module) and contracts `(inputs, kernel)`
  through it. The kernel is the weight; roles are named by the calling layer's path.
- NNX: `dot_general(name, recipe=None)` for `nnx.Linear(..., dot_general=...)` /
  `nnx.LinearGeneral`, and `einsum_op(name, recipe=None)` for `nnx.Einsum(...,
  einsum_op=...)`: plain functions (NNX layers do not know their path, hence `name`).
  They hold no state and no RNG, so they take recipes without delayed scaling (a clear
  error otherwise), and a recipe that rounds stochastically only where no key is needed: a
  forward alone under nvfp4 (evaluation, generation), whose rounding is the gradients';
  differentiating it asks for the key they cannot draw. jaxquant's own NNX layers and
  `quantize_model(..., rngs=)` take any recipe.
- MaxText: `MaxTextQuantization(recipe)` has MaxText's quantization protocol:
  `dot_general_cls(mesh_axes=())` returns the Linen class above, `einsum(dtype)` a Linen
  module called as `(equation, lhs, rhs)` with rhs the weight; `quant_mode` and
  `needs_apply_rngs` are what MaxText's layers read. MaxText's NNX layers bridge such a
  module alone into NNX, so it has no path there: `_bridged` finds the calling layer's
  (named by `quantize_model`) and keeps delayed-scaling state where MaxText's train step
  advances it.

The recipe resolves as everywhere: the hook's own, then the model's (when the model runs
under `quantize_model`), then autocast's. With nothing quantized the contraction is
exactly `lax.dot_general` / `jnp.einsum` (bit-identical).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant import recipes
from jaxquant.flax.swap import _bridged as bridged
from jaxquant.flax.swap._hosts import HookHost, LinenHost
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._calls import Call
from jaxquant.intercept._hosts import KERNEL, WeightRef
from jaxquant.intercept._keys import draws_key
from jaxquant.intercept._routed import handle
from jaxquant.roles import GROUPED_LINEAR, LINEAR


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


def _hooked(module: nn.Module, contract: bridged.Contract, plain, lhs, rhs):
  """A Linen hook's contraction: inside a Linen model its parent is the calling layer;
  a hook with no path is bridged into NNX on its own (MaxText's NNX layers: `_bridged`)."""
  if module.path:
    return contract(WeightRef("/".join(module.path[:-1]), KERNEL, LinenHost(module)), lhs, rhs)
  return bridged.contract(module, module.recipe, contract, plain, lhs, rhs)


class JaxquantDotGeneral(nn.Module):
  """Linen: `lax.dot_general(lhs, rhs, dimension_numbers, ...)` with rhs the weight."""

  recipe: Optional[recipes.CustomRecipe] = None

  def __call__(
    self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
  ):
    if precision is None and not self.path:  # bridged alone: MaxText keeps it on the layer
      precision = bridged.caller_precision()
    kwargs = dict(precision=precision, preferred_element_type=preferred_element_type, **kwargs)

    def contract(weight, lhs, rhs):
      args = (lhs, rhs, dimension_numbers)
      return _contract("dot_general", args, kwargs, weight, self.recipe, jax.lax.dot_general)

    plain = lambda lhs, rhs: jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    return _hooked(self, contract, plain, lhs, rhs)


class JaxquantEinsum(nn.Module):
  """Linen: `jnp.einsum(equation, lhs, rhs, ...)` with rhs the weight (MaxText's
  `quant.einsum()` protocol)."""

  recipe: Optional[recipes.CustomRecipe] = None
  dtype: Any = None  # the rhs is cast to it first, as MaxText's einsum wrappers do

  def __call__(self, equation, lhs, rhs, **kwargs):
    if self.dtype is not None:
      rhs = jnp.asarray(rhs, self.dtype)
    if kwargs.get("precision") is None and not self.path:  # as JaxquantDotGeneral
      precision = bridged.caller_precision()
      kwargs = kwargs if precision is None else dict(kwargs, precision=precision)
    return _hooked(
      self,
      lambda weight, lhs, rhs: _contract(
        "einsum", (equation, lhs, rhs), kwargs, weight, self.recipe, jnp.einsum
      ),
      lambda lhs, rhs: jnp.einsum(equation, lhs, rhs, **kwargs),
      lhs,
      rhs,
    )


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
    weight = WeightRef(self.name, KERNEL, HookHost())
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
    weight = WeightRef(self.name, KERNEL, HookHost())
    return _contract("einsum", (equation, lhs, rhs), kwargs, weight, self.recipe, jnp.einsum)


@dataclasses.dataclass(frozen=True)
class MaxTextQuantization:
  """MaxText's quantization protocol (`quant=` of its layers), backed by a jaxquant recipe."""

  recipe: Optional[recipes.CustomRecipe] = None
  # MaxText's layers read it (serving and converting checkpoints are AQT's modes).
  quant_mode: ClassVar[str] = "train"

  @property
  def needs_apply_rngs(self) -> bool:
    """Whether the hooks draw keys when applied: MaxText keeps a layer's Rngs for its
    hook only then. True without a recipe of its own (the model's or autocast's is not
    known when MaxText asks, building the layer), else whether the recipe rounds
    stochastically for the role name a layer being built is asked for ("")."""
    if self.recipe is None:
      return True
    recipe = recipes.resolve(self.recipe)
    return any(
      draws_key(recipe.quantizers(t, bridged.BUILDING_NAME)) for t in (LINEAR, GROUPED_LINEAR)
    )

  def dot_general_cls(self, mesh_axes: tuple = ()):
    del mesh_axes  # jaxquant's kernels partition per operand sharding (see README)
    return dot_general_cls(self.recipe)

  def einsum(self, dtype: Any = None, mesh_axes: tuple = ()):
    """MaxText's MoE asks `einsum(mesh_axes=...)`, its FP8 paths `einsum(dtype=...)`."""
    del mesh_axes
    return JaxquantEinsum(recipe=self.recipe, dtype=dtype)

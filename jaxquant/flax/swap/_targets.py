"""What the swap-in intercepts, as data: every entry point it takes over, and its route.

- `contraction_targets()`: the functions and operators a model's code calls to contract
  two arrays. While a `routing` context is open (`_interception`), each dispatches: it
  hands the handler a `Call` of the target's kind.
- `LINEN_LAYERS`: the Linen layers whose `__call__` the method interceptor (`_linen`) runs
  itself, each through its route, with routing paused (their GEMM is theirs).
- `NNX_LAYERS`: the NNX layers replaced, in place, by jaxquant's twin (`_nnx`), and
  `NNX_NATIVE_LAYERS`: jaxquant's own, bound to their module path and the model recipe.

Stock layers are matched by exact class: a subclass may compute something else.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxquant.flax import _grouped as grouped
from jaxquant.flax import linen
from jaxquant.flax import nnx as jq_nnx
from jaxquant.flax.swap._hooks import uses_jaxquant_hook


@dataclasses.dataclass(frozen=True)
class ContractionTarget:
  """`owner.attribute`, routed as a `Call` of `kind`. `operator`: None for a function,
  "left" for `a @ b` (`__matmul__`), "right" for its reflection (`__rmatmul__`), whose
  call then holds the operands in mathematical order."""

  owner: Any
  attribute: str
  kind: str
  operator: Optional[str] = None


@functools.cache
def contraction_targets() -> tuple[ContractionTarget, ...]:
  """The same targets for every thread and trace. `@` is taken over on `jax.core.Tracer`
  (every tracer class inherits its operators) and on the concrete array class, which
  owns operators of its own. `ragged_dot` is `ragged_dot_general` with the plain
  dimension numbers (`[M, K]` rows in groups, `[G, K, N]`); JAX's `ragged_dot` calls
  `ragged_dot_general` from its own module, which is not routed again."""
  # The concrete class is found by building an array, so on first use rather than at
  # import (which would start JAX's backend), and at compile time: inside a trace
  # `jnp.zeros` gives a tracer.
  with jax.ensure_compile_time_eval():
    array_class = type(jnp.zeros(()))
  return (
    ContractionTarget(jax.lax, "dot_general", "dot_general"),
    ContractionTarget(jax.lax, "ragged_dot", "ragged_dot"),
    ContractionTarget(jax.lax, "ragged_dot_general", "ragged_dot_general"),
    ContractionTarget(jnp, "einsum", "einsum"),
    ContractionTarget(jnp, "dot", "dot"),
    ContractionTarget(jnp, "matmul", "matmul"),
    *(
      ContractionTarget(cls, attribute, "matmul", operator)
      for cls in (jax.core.Tracer, array_class)
      for attribute, operator in (("__matmul__", "left"), ("__rmatmul__", "right"))
    ),
  )


def _native(module, next_fun, args, kwargs, *, recipe, annotate):
  """jaxquant's own layer: the model recipe as the fallback of its own."""
  return linen.native_call(module, *args, model_recipe=recipe, **kwargs)


def _grouped(module, next_fun, args, kwargs, *, recipe, annotate):
  return grouped.linen_call(module, *args, model_recipe=recipe, **kwargs)


def _stock(module, next_fun, args, kwargs, *, recipe, annotate):
  """Flax's layer computed by `linen.gemm_call` from its own attributes and params."""
  return linen.gemm_call(module, next_fun, args, kwargs, model_recipe=recipe, annotate=annotate)


@dataclasses.dataclass(frozen=True)
class LinenLayer:
  """`classes` (exactly these with `exact`, else with subclasses) whose `__call__` runs
  as `route(module, next_fun, args, kwargs, recipe=, annotate=)`, unless `keep(module)`."""

  classes: tuple[type, ...]
  exact: bool
  route: Callable[..., Any]
  keep: Callable[[nn.Module], bool] = lambda module: False

  def matches(self, module: nn.Module) -> bool:
    if self.exact:
      found = type(module) in self.classes
    else:
      found = isinstance(module, self.classes)
    return found and not self.keep(module)


LINEN_LAYERS = (
  LinenLayer(linen.QUANTIZED_MODULES, exact=False, route=_native),
  LinenLayer((grouped.GroupedDense,), exact=False, route=_grouped),
  # A stock layer given jaxquant's dot_general_cls quantizes through that hook already.
  LinenLayer(
    (nn.Dense, nn.DenseGeneral, nn.Einsum), exact=True, route=_stock, keep=uses_jaxquant_hook
  ),
)

# Stock NNX layer -> its jaxquant twin (same constructor arguments and Params).
NNX_LAYERS = {nnx.Linear: jq_nnx.Linear, nnx.Einsum: jq_nnx.Einsum}
NNX_NATIVE_LAYERS = jq_nnx.QUANTIZED_MODULES + (grouped.NnxGroupedDense,)

"""The Linen side of routed contractions: which module's param an operand is, and where
its delayed-scaling state and stochastic-rounding key come from.

`ModuleStack` holds the modules whose methods are running (pushed by the swap-in's
method interceptor, innermost last). An operand is a weight when it is one of those
modules' own params (`provenance.find`: the param, or a cast / view of it), innermost
module first; that module owns it (with `nn.share_scope`, the scope's module path).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import flax.linen as nn
import jax
from flax.core import meta

from jaxquant.flax import provenance
from jaxquant.flax.session import WeightRef
from jaxquant.flax.state import QUANT_STATE, init_role_states
from jaxquant.quantizers import needs_key, needs_state

QUANT_RNG = "quant"


def _raw(value: Any) -> Any:
  """A param as its module stores it, without boxes (and without their sharding
  constraint: the walk from an operand passes through the constraint to this value)."""
  while isinstance(value, meta.AxisMetadata):
    value = value.value if hasattr(value, "value") else value.unbox()
  return value


def own_params(module: nn.Module) -> dict[str, Any]:
  """The params of the module's own scope (not its children's), unboxed."""
  params = module.variables.get("params", {})
  return {name: _raw(v) for name, v in params.items() if not isinstance(v, Mapping)}


def _is_weight_like(value) -> bool:
  return len(getattr(value, "shape", ())) >= 2


@dataclasses.dataclass
class LinenHost:
  """Where a Linen weight's GEMM keeps its state: the owner module's "quant_state"
  collection, at `<param>_<tensor_type>`; its key: the owner's "quant" RNG stream."""

  module: nn.Module
  variables: dict = dataclasses.field(default_factory=dict)

  def key(self, quantizers, what: str) -> Optional[jax.Array]:
    if not any(needs_key(q) for q in quantizers.values()):
      return None
    if self.module.is_initializing():
      return jax.random.key(0)  # init needs shapes only; the params stream stays untouched
    if not self.module.has_rng(QUANT_RNG):
      raise ValueError(
        f"{what}: its recipe rounds stochastically; pass a PRNG key for the "
        f"{QUANT_RNG!r} stream: model.apply(..., rngs={{'{QUANT_RNG}': key}})"
      )
    return self.module.make_rng(QUANT_RNG)

  def state(self, param: str, roles, quantizers, what: str) -> Optional[dict]:
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    fresh = lambda t: init_role_states(roles, quantizers)[t]
    # scope.variable, not module.variable: the owner need not be in a compact method.
    variables = {
      t: self.module.scope.variable(QUANT_STATE, f"{param}_{t}", fresh, t) for t in stateful
    }
    for t, v in variables.items():
      if v.value.quantizer != stateful[t]:
        raise ValueError(
          f"{what}: its {QUANT_STATE} for {t!r} was made for "
          f"{v.value.quantizer!r} but the recipe now gives {stateful[t]!r}; "
          f"re-initialise the {QUANT_STATE} collection"
        )
    self.variables[param] = variables
    return {t: v.value.scaling for t, v in variables.items()}

  def write_state(self, param: str, new_state: dict) -> None:
    if self.module.is_initializing() or not self.module.is_mutable_collection(QUANT_STATE):
      return
    for t, v in self.variables[param].items():
      v.value = dataclasses.replace(v.value, scaling=new_state[t])


@dataclasses.dataclass
class ModuleStack:
  """The Linen modules whose methods are running, innermost last."""

  modules: list = dataclasses.field(default_factory=list)

  @contextlib.contextmanager
  def running(self, module: nn.Module):
    self.modules.append(module)
    try:
      yield
    finally:
      self.modules.pop()

  def find_weight(self, operand) -> Optional[WeightRef]:
    for module in reversed(self.modules):
      if module.scope is None:
        continue
      params = own_params(module)
      name = provenance.find(operand, params)
      if name is not None:
        weights = [n for n, v in params.items() if _is_weight_like(v)]
        return WeightRef("/".join(module.path), name, weights == [name], LinenHost(module))
    return None

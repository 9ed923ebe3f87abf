"""Where a routed weight GEMM keeps its delayed-scaling state and draws its key: its host.

A weight the model's code contracts belongs to a host: the Linen module that owns the
param (`LinenHost`), a quantized NNX model (`NnxHost`), or an NNX `dot_general` /
`einsum_op` hook (`HookHost`), which holds neither state nor RNG. The handler of routed
contractions (`_routed`) asks the weight's host through the `Host` protocol alone.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

import flax.linen as nn
import jax
from flax import nnx

from jaxquant.flax import linen
from jaxquant.flax._rng import draws_key, linen_key, nnx_key
from jaxquant.flax._state import QUANT_STATE, init_role_states
from jaxquant.quantizers import Quantizer, needs_state
from jaxquant.roles import QuantizerRole

Quantizers = dict[str, Optional[Quantizer]]
KERNEL = "kernel"  # the param name Flax's layers give their one weight


class Host(Protocol):
  """What the handler asks of the owner of a weight operand; `what` names the GEMM in errors."""

  def key(self, quantizers: Quantizers, what: str) -> Optional[jax.Array]:
    """The stochastic-rounding key of the GEMM (None when no quantizer rounds so)."""

  def state(
    self, param: str, roles: dict[str, QuantizerRole], quantizers: Quantizers, what: str
  ) -> Optional[dict]:
    """{tensor_type: DelayedScalingState} for the delayed-scaling quantizers, else None."""

  def write_state(self, param: str, new_state: dict) -> None:
    """Stores the state the GEMM returned (called only when `state` gave one)."""


@dataclasses.dataclass(frozen=True)
class WeightRef:
  """A param the model's code contracted: its owner's path, its name and the owner's host."""

  path: str
  param: str
  host: Host

  @property
  def role_name(self) -> str:
    """The owner's path for a `kernel` (Flax's name for a layer's one weight, as the stock
    layers' roles are named), else the param's full path; the root module's weights by
    their own name. The rule reads this param alone, so a role keeps its name when the
    owner gains or loses sibling params (a policy written for it keeps matching)."""
    if not self.path:
      return self.param
    return self.path if self.param == KERNEL else f"{self.path}/{self.param}"


@dataclasses.dataclass
class LinenHost:
  """A Linen module: state in its "quant_state" collection at `<param>_<tensor_type>`;
  keys from its "quant" RNG stream."""

  module: nn.Module
  variables: dict = dataclasses.field(default_factory=dict)

  def key(self, quantizers, what: str) -> Optional[jax.Array]:
    return linen_key(self.module, quantizers, what)

  def state(self, param: str, roles, quantizers, what: str) -> Optional[dict]:
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    fresh = lambda t: init_role_states(roles, quantizers)[t]
    # scope.variable, not module.variable: the owner need not be in a compact method.
    variables = {
      t: self.module.scope.variable(QUANT_STATE, f"{param}_{t}", fresh, t) for t in stateful
    }
    self.variables[param] = variables
    return linen.checked_states(variables, stateful, what)

  def write_state(self, param: str, new_state: dict) -> None:
    linen.write_states(self.module, self.variables[param], new_state)


@dataclasses.dataclass(frozen=True)
class NnxHost:
  """A quantized NNX model: keys from the `rngs` given to `quantize_model`; no
  delayed-scaling state (it would have to exist before the first trace)."""

  rngs: Optional[nnx.Rngs]

  def key(self, quantizers, what: str) -> Optional[jax.Array]:
    return nnx_key(self.rngs, quantizers, what, "rngs=nnx.Rngs(quant=seed) to quantize_model")

  def state(self, param, roles, quantizers, what: str) -> None:
    if any(needs_state(q) for q in quantizers.values()):
      raise ValueError(
        f"{what}: delayed scaling needs state that an NNX model's routed "
        "contractions do not hold; use a current-scaling recipe for this role "
        "or build the layer from jaxquant.flax.nnx's Linear / Einsum"
      )
    return None

  def write_state(self, param, new_state) -> None:
    raise AssertionError("routed NNX contractions hold no state")


@dataclasses.dataclass(frozen=True)
class HookHost:
  """An NNX `dot_general` / `einsum_op` hook: a plain function, no state, no RNG."""

  def key(self, quantizers, what: str) -> None:
    if draws_key(quantizers):
      raise ValueError(
        f"{what}: an NNX dot_general / einsum_op hook cannot draw keys for "
        "stochastic rounding; use jaxquant.flax.nnx's layers or quantize_model"
      )
    return None

  def state(self, param, roles, quantizers, what: str) -> None:
    if any(needs_state(q) for q in quantizers.values()):
      raise ValueError(
        f"{what}: an NNX dot_general / einsum_op hook holds no delayed-scaling "
        "state; use jaxquant.flax.nnx's layers or quantize_model"
      )
    return None

  def write_state(self, param, new_state) -> None:
    raise AssertionError("an NNX hook holds no state")

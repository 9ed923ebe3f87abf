"""Where a routed weight GEMM keeps its delayed-scaling state and draws its key: its host.

A weight the model's code contracts belongs to a host: the Linen module that owns the
param (`LinenHost`), the NNX module of a quantized NNX model that owns it (`NnxHost`), or
an NNX `dot_general` / `einsum_op` hook (`HookHost`), which holds neither state nor RNG.
The handler of routed contractions (`_routed`) asks the weight's host through the `Host`
protocol alone.

A weight GEMM keeps one state per delayed-scaling role; a grouped one (MoE experts: a
ragged dot, or a batched einsum run as one grouped GEMM) one per group, with a leading
[G] axis (`ops.grouped_dense`'s), which `update_quant_state` advances per group. The
state is made at the GEMM's first traced call: at `init` in Linen; in NNX, by the call
that first meets it (the model exists before any trace, its routed contractions are
found only by running it), a `QuantState` added to the owner module, which `nnx.jit`
and `nnx.grad` hand back to the model like any change of its state (in a model built
with MaxText's `quant=` hooks, an `_overwrite_with_gradient` variable:
`_bridged.GradientStateHost`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol

import flax.errors
import flax.linen as nn
import jax
from flax import nnx

from jaxquant.flax import linen
from jaxquant.flax._rng import draws_key, linen_key, nnx_key
from jaxquant.flax._state import (
  QUANT_STATE,
  QuantState,
  init_grouped_role_states,
  init_role_states,
  is_role_state,
)
from jaxquant.quantizers import Quantizer, needs_state
from jaxquant.roles import QuantizerRole

Quantizers = dict[str, Optional[Quantizer]]
KERNEL = "kernel"  # the param name Flax's layers give their one weight
# `gemm(operands, state) -> (y, new_state)`: a weight GEMM of `operands` under its
# delayed-scaling `state` ({tensor_type: DelayedScalingState}, None: none), returning the
# state it recorded (None: none).
StatefulGemm = Callable[[tuple, Optional[dict]], tuple[jax.Array, Optional[dict]]]


class Host(Protocol):
  """What the handler asks of the owner of a weight operand; `what` names the GEMM in errors."""

  def key(self, quantizers: Quantizers, what: str, optional: bool = False) -> Optional[jax.Array]:
    """The stochastic-rounding key of the GEMM (None when no quantizer rounds so). With no
    stream to draw from: None where `optional` (the GEMM's op asks for it where it rounds),
    else an error saying how to give one."""

  def state(
    self,
    param: str,
    roles: dict[str, QuantizerRole],
    quantizers: Quantizers,
    what: str,
    num_groups: Optional[int] = None,
  ) -> Optional[dict]:
    """{tensor_type: DelayedScalingState} for the delayed-scaling quantizers, else None;
    one per group (a leading [num_groups] axis) for a grouped GEMM."""

  def write_state(self, param: str, new_state: dict) -> None:
    """Stores the state the GEMM returned (called only when `state` gave one)."""

  def run(self, param: str, gemm: StatefulGemm, operands: tuple, state: Optional[dict]):
    """The output of `gemm(operands, state)` (`state` as this host's `state` gave it);
    the state it returns kept as the host keeps it."""


class WritesBack:
  """`Host.run` of a host that stores the state the GEMM returned (`write_state`)."""

  def run(self, param: str, gemm: StatefulGemm, operands: tuple, state: Optional[dict]):
    y, new_state = gemm(operands, state)
    if new_state is not None:
      self.write_state(param, new_state)
    return y


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
class LinenHost(WritesBack):
  """A Linen module: state in its "quant_state" collection at `<param>_<tensor_type>`;
  keys from its "quant" RNG stream."""

  module: nn.Module
  variables: dict = dataclasses.field(default_factory=dict)

  def key(self, quantizers, what: str, optional: bool = False) -> Optional[jax.Array]:
    return linen_key(self.module, quantizers, what, optional=optional)

  def state(self, param: str, roles, quantizers, what: str, num_groups=None) -> Optional[dict]:
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    fresh = lambda t: _fresh_states(roles, quantizers, num_groups)[t]
    # scope.variable, not module.variable: the owner need not be in a compact method.
    variables = {
      t: self.module.scope.variable(QUANT_STATE, f"{param}_{t}", fresh, t) for t in stateful
    }
    self.variables[param] = variables
    return linen.checked_states(variables, stateful, what)

  def write_state(self, param: str, new_state: dict) -> None:
    linen.write_states(self.module, self.variables[param], new_state)


def _fresh_states(roles, quantizers, num_groups: Optional[int]) -> dict:
  if num_groups is None:
    return init_role_states(roles, quantizers)
  return init_grouped_role_states(roles, quantizers, num_groups)


def nnx_state_attr(param: str) -> str:
  """The attribute of an NNX module holding the state of its param `param`'s GEMM."""
  return f"{param}_{QUANT_STATE}"


@dataclasses.dataclass(frozen=True)
class NnxHost(WritesBack):
  """The NNX module owning the weight, in a quantized NNX model: its state a `QuantState`
  at `<module path>/<param>_quant_state` ({tensor_type: RoleState}), made at the GEMM's
  first call (and made anew for a recipe that changed its quantizers, as a fresh process
  would); keys from the model call's (`rngs` given to `quantize_model`)."""

  module: Optional[nnx.Module] = None
  rngs: Optional[nnx.Rngs] = None

  def variable(self, states: dict) -> nnx.Variable:
    """The Variable that holds a GEMM's states ({tensor_type: RoleState})."""
    return QuantState(states)

  def key(self, quantizers, what: str, optional: bool = False) -> Optional[jax.Array]:
    how_to_pass = "rngs=nnx.Rngs(quant=seed) to quantize_model"
    return nnx_key(self.rngs, quantizers, what, how_to_pass, optional=optional)

  def state(self, param, roles, quantizers, what: str, num_groups=None) -> Optional[dict]:
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    attr = nnx_state_attr(param)
    held = getattr(self.module, attr, None)
    held = {} if held is None else held.get_value()
    for t, state in held.items():
      if not is_role_state(state):
        raise TypeError(
          f"{what}: {nnx_state_attr(param)}[{t!r}] holds a {type(state).__name__}, not a "
          "jaxquant.flax.RoleState; a checkpoint restored without a target gives plain "
          "dicts. Restore it with the model's state as the target (nnx.state(model) of "
          "the model as it was saved)"
        )
    want = () if num_groups is None else (num_groups,)
    if set(held) != set(stateful) or any(
      held[t].quantizer != q or held[t].scaling.scale.shape != want for t, q in stateful.items()
    ):
      held = _fresh_states(roles, quantizers, num_groups)
      self._set(attr, held, what)
    return {t: held[t].scaling for t in stateful}

  def write_state(self, param, new_state) -> None:
    variable = getattr(self.module, nnx_state_attr(param))
    held = variable.get_value()
    variable.set_value(
      {t: dataclasses.replace(s, scaling=new_state.get(t, s.scaling)) for t, s in held.items()}
    )

  def _set(self, attr: str, states: dict, what: str) -> None:
    try:
      setattr(self.module, attr, self.variable(states))
    except flax.errors.TraceContextError as error:
      raise ValueError(
        f"{what}: its delayed-scaling state is made at its first call, which runs here "
        "inside a JAX transform that closes over the model (NNX cannot add the state "
        "there). Call the model once outside it first (eagerly or under nnx.jit), or "
        "pass the model to nnx.jit / nnx.grad as an argument"
      ) from error


@dataclasses.dataclass(frozen=True)
class HookHost(WritesBack):
  """An NNX `dot_general` / `einsum_op` hook: a plain function, no state, no RNG. A
  forward that rounds nothing stochastically (every preset's: nvfp4 rounds its gradients
  so) runs; a quantizer that rounds stochastically where the call runs (a backward pass
  being traced, or a forward quantizer) asks for the key the hook cannot draw, in the op's
  error (`ops.dense`, `_grouped.without_key`)."""

  def key(self, quantizers, what: str, optional: bool = False) -> None:
    if draws_key(quantizers) and not optional:
      raise ValueError(
        f"{what}: an NNX dot_general / einsum_op hook cannot draw keys for "
        "stochastic rounding; use jaxquant.flax.nnx's layers or quantize_model"
      )
    return None

  def state(self, param, roles, quantizers, what: str, num_groups=None) -> None:
    if any(needs_state(q) for q in quantizers.values()):
      raise ValueError(
        f"{what}: an NNX dot_general / einsum_op hook holds no delayed-scaling "
        "state; use jaxquant.flax.nnx's layers or quantize_model"
      )
    return None

  def write_state(self, param, new_state) -> None:
    raise AssertionError("an NNX hook holds no state")

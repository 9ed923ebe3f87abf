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
from typing import Optional

import flax.errors
import flax.linen as nn
import jax
from flax import nnx

from jaxquant.flax import linen
from jaxquant.flax._rng import linen_key, nnx_key
from jaxquant.flax._state import QUANT_STATE, QuantState
from jaxquant.intercept._hosts import WritesBack
from jaxquant.intercept._keys import draws_key
from jaxquant.intercept._role_state import init_grouped_role_states, init_role_states, is_role_state
from jaxquant.quantizers import needs_state


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

"""Delayed-scaling state of Flax modules: where it lives and how a train step advances it.

A quantized module keeps one `RoleState` per role whose quantizer needs state
(`quantizers.needs_state`), nowhere else:

- Linen: in the `"quant_state"` collection (`QUANT_STATE`), at
  `quant_state/<module path>/<tensor_type>`;
- NNX: in a `QuantState` Variable, at `<module path>/quant_state/<tensor_type>`.

A `RoleState` is the `DelayedScalingState` arrays plus, as static pytree metadata, the
role and its quantizer, so a train step can advance every state without knowing the
recipe or the model. Per step (NUMERICS.md, "Delayed scaling"):

1. the forward pass quantizes with the stored scales and records the input and weight
   amaxes (the module writes them back when the collection is mutable);
2. the grad_output amax, known only in backward, comes back as the gradient of the loss
   with respect to the state the step started from;
3. `update_quant_state(forward_state, state_grads)` folds (2) into (1) and runs
   `scaling.update` once.

Under gradient accumulation, merge the micro-batches' forward states and state
gradients with `combine_quant_state` (max) before step 3. States stacked by
`nn.scan` / `nnx.scan` (a leading layer axis) are advanced per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxquant import scaling
from jaxquant.quantizers import DelayedFloat8Quantizer, Quantizer, for_usage, needs_state
from jaxquant.roles import QuantizerRole

QUANT_STATE = "quant_state"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoleState:
  """The delayed-scaling state of one role, labelled with the role and its quantizer."""

  scaling: scaling.DelayedScalingState
  role: QuantizerRole = dataclasses.field(metadata=dict(static=True))
  quantizer: Quantizer = dataclasses.field(metadata=dict(static=True))


def is_role_state(x: Any) -> bool:
  return isinstance(x, RoleState)


def _delayed(quantizer: Quantizer) -> DelayedFloat8Quantizer:
  """The delayed-scaling side of a quantizer (a hybrid may have it on one usage only)."""
  for usage in ("rowwise", "columnwise"):
    q = for_usage(quantizer, usage)
    if isinstance(q, DelayedFloat8Quantizer):
      return q
  raise ValueError(f"{quantizer!r} does not use delayed scaling")


def init_role_states(roles: dict[str, QuantizerRole],
                     quantizers: dict[str, Optional[Quantizer]]) -> dict[str, RoleState]:
  """Fresh states for exactly the roles whose quantizer needs state."""
  return {t: RoleState(scaling.init_state(_delayed(q)), roles[t], q)
          for t, q in quantizers.items() if needs_state(q)}


def stacked_role_states(states: dict[str, RoleState], leading: tuple[int, ...]
                        ) -> dict[str, RoleState]:
  """States for a layer stacked along `leading` axes (scanned layers: one state each)."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, leading + a.shape), states)


def _per_layer(fn, *states: scaling.DelayedScalingState):
  """Applies fn to each unstacked state: scan adds leading axes to the history [L]."""
  for _ in range(states[0].amax_history.ndim - 1):
    fn = jax.vmap(fn)
  return fn(*states)


def update_quant_state(quant_state: Any, state_grads: Any = None) -> Any:
  """Advances every `RoleState` in `quant_state` by one training step.

  For an NNX model, pass the model itself and the grads of the step (an `nnx.State`
  holding the `QuantState` gradients, e.g. from `nnx.grad(..., argnums=nnx.DiffState(0,
  (nnx.Param, QuantState)))`): the model's state is updated in place and returned.

  Args:
    quant_state: any pytree holding RoleStates (a Linen `"quant_state"` collection, an
      NNX `nnx.State` of `QuantState` variables, or a dict containing either), as the
      forward pass of this step left it (input and weight amaxes recorded).
    state_grads: the gradient of the loss with respect to the state the step started
      from, with the same structure; it carries the grad_output amaxes. None skips
      them (e.g. a forward-only calibration step).

  Returns:
    The state for the next step: the new scales, the histories rolled.
  """
  def advance(state, grad):
    if not isinstance(state, RoleState):  # e.g. params beside the collection
      return state
    s = state.scaling
    if grad is not None and state.role.tensor_type == "grad_output":
      s = _per_layer(scaling.record_grad_amax, s, grad.scaling)
    q = _delayed(state.quantizer)
    return dataclasses.replace(state, scaling=_per_layer(lambda x: scaling.update(x, q), s))

  from flax import nnx  # only to recognise an NNX model
  if isinstance(quant_state, nnx.Module):
    from jaxquant.flax.nnx import QuantState
    model = quant_state
    grads = None if state_grads is None else nnx.filter_state(state_grads, QuantState)
    new_state = update_quant_state(nnx.state(model, QuantState), grads)
    nnx.update(model, new_state)
    return new_state
  if state_grads is None:
    return jax.tree.map(lambda s: advance(s, None), quant_state, is_leaf=is_role_state)
  return jax.tree.map(advance, quant_state, state_grads, is_leaf=is_role_state)


def combine_quant_state(a: Any, b: Any) -> Any:
  """Merges two records of one step (micro-batches, or their state gradients) by max."""
  return jax.tree.map(
      lambda x, y: dataclasses.replace(x, scaling=scaling.combine(x.scaling, y.scaling)),
      a, b, is_leaf=is_role_state)

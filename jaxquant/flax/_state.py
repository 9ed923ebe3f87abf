"""Delayed-scaling state of Flax modules: where it lives (the `RoleState`s themselves and
their update are `jaxquant.intercept._role_state`'s).

A quantized module keeps one `RoleState` per role whose quantizer needs state, nowhere
else:

- Linen: in the `"quant_state"` collection (`QUANT_STATE`), at
  `quant_state/<module path>/<tensor_type>`;
- NNX: in a `QuantState` Variable, at `<module path>/quant_state/<tensor_type>`.

A weight GEMM that a model's own code makes (routed by the swap-in) keeps its states
beside its param (`<param>_<tensor_type>` in Linen's collection, an NNX
`<param>_quant_state` Variable made at its first call).

`update_quant_state` and `recorded_amaxes_finite` take any pytree of states, and an NNX
model itself too.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxquant.intercept import _role_state as role_state
from jaxquant.intercept._role_state import is_role_state

QUANT_STATE = "quant_state"


class QuantState(nnx.Variable):
  """Delayed-scaling state of one NNX layer: {tensor_type: RoleState}."""


def _nnx_quant_states(model: nnx.Module, state_grads: Any):
  """The model's `QuantState`s and their gradients, the latter shaped as the former: None
  for a state the step made (a routed contraction's, made at its first call), which the
  step could not differentiate."""
  states = nnx.state(model, QuantState)
  if state_grads is None:
    return states, None
  flat_grads = jax.tree_util.tree_flatten_with_path(
    nnx.filter_state(state_grads, QuantState), is_leaf=is_role_state
  )[0]
  grads = dict(flat_grads)
  return states, jax.tree_util.tree_map_with_path(
    lambda path, _: grads.get(path), states, is_leaf=is_role_state
  )


def update_quant_state(
  quant_state: Any, state_grads: Any = None, *, finite=True, outlier_factor=None
) -> Any:
  """`jaxquant.intercept`'s `update_quant_state` (every argument as there), and for an NNX
  model: pass the model itself and the grads of the step (an `nnx.State` holding the
  `QuantState` gradients, e.g. from `nnx.grad(..., argnums=nnx.DiffState(0, (nnx.Param,
  QuantState)))`): the model's state is updated in place and returned."""
  options = dict(finite=finite, outlier_factor=outlier_factor)
  if isinstance(quant_state, nnx.Module):
    model = quant_state
    new_state = role_state.update_quant_state(*_nnx_quant_states(model, state_grads), **options)
    nnx.update(model, new_state)
    return new_state
  return role_state.update_quant_state(quant_state, state_grads, **options)


def recorded_amaxes_finite(quant_state: Any, state_grads: Any = None) -> jax.Array:
  """`jaxquant.intercept`'s `recorded_amaxes_finite`, an NNX model taken too (as
  `update_quant_state`)."""
  if isinstance(quant_state, nnx.Module):
    return role_state.recorded_amaxes_finite(*_nnx_quant_states(quant_state, state_grads))
  return role_state.recorded_amaxes_finite(quant_state, state_grads)

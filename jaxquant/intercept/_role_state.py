"""Delayed-scaling state as a pytree, and how a train step advances it.

Every GEMM that quantizes with delayed scaling keeps one `RoleState` per role whose
quantizer needs state (`quantizers.needs_state`): the `DelayedScalingState` arrays plus,
as static pytree metadata, the role and its quantizer, so a train step can advance every
state without knowing the recipe or the model. Where the states live is the
integration's: a Flax collection or NNX variable (`jaxquant.flax`), a quantized
function's explicit state (`jaxquant.functional`). A grouped GEMM's states hold one
state per group, a leading axis that `update_quant_state` treats like a stack of layers'.

Per step (NUMERICS.md, "Delayed scaling"):

1. the forward pass quantizes with the stored scales and records the input and weight
   amaxes (the integration hands back the state it recorded);
2. the grad_output amax, known only in backward, comes back as the gradient of the loss
   with respect to the state the step started from;
3. `update_quant_state(forward_state, state_grads)` folds (2) into (1) and runs
   `scaling.update` once; `finite=False` (a step the optimizer skipped) hands every
   state back as the step found it. `recorded_amaxes_finite(forward_state, state_grads)`
   says whether every amax the step recorded is finite, for the step's finiteness check
   (an FP8 cast saturates an inf input, so neither the loss nor the gradients show it).

Under gradient accumulation, merge the micro-batches' forward states and state
gradients with `combine_quant_state` (max) before step 3. States stacked by a scan (a
leading layer axis) are advanced per layer.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxquant import scaling
from jaxquant.ops import _delayed_state as delayed_state
from jaxquant.ops._grouped_dense import init_grouped_state
from jaxquant.quantizers import DelayedFloat8Quantizer, Quantizer, for_usage, needs_state
from jaxquant.roles import QuantizerRole

_log = logging.getLogger(__name__)


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


def init_role_states(
  roles: dict[str, QuantizerRole], quantizers: dict[str, Optional[Quantizer]]
) -> dict[str, RoleState]:
  """Fresh states for exactly the roles whose quantizer needs state."""
  return {
    t: RoleState(scaling.init_state(_delayed(q)), roles[t], q)
    for t, q in quantizers.items()
    if needs_state(q)
  }


def init_grouped_role_states(
  roles: dict[str, QuantizerRole], quantizers: dict[str, Optional[Quantizer]], num_groups: int
) -> dict[str, RoleState]:
  """Fresh states, one per group (`ops.grouped_dense`'s: a leading [num_groups] axis), for
  exactly the roles whose quantizer needs state; advanced per group like stacked layers'."""
  return {
    t: RoleState(state, roles[t], quantizers[t])
    for t, state in init_grouped_state(quantizers, num_groups).items()
  }


def stacked_role_states(
  states: dict[str, RoleState], leading: tuple[int, ...]
) -> dict[str, RoleState]:
  """States for a layer stacked along `leading` axes (scanned layers: one state each)."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, leading + a.shape), states)


def _per_layer(fn, *states: scaling.DelayedScalingState):
  """Applies fn to each unstacked state: scan adds leading axes to the history [L]."""
  for _ in range(states[0].amax_history.ndim - 1):
    fn = jax.vmap(fn)
  return fn(*states)


def _advance_group(quantizer: DelayedFloat8Quantizer, states, grads, options):
  """One step of `len(states)` states of one quantizer and shape. Where the update's exact
  fp32 division is the kernel's, each state on its own. Where it is the reference's
  integer emulation, one vectorized computation for the group: a copy of the emulation
  per role (three per linear layer) multiplied a step's compile time and its tiny
  kernels. With the kernel it is the stacking that costs compile time, the concatenations
  and the slices handing each state back (docs/benchmarks.md, "Where the compile time
  goes"). Elementwise either way, so every state gets the bits it would alone."""
  stack = lambda items: jax.tree.map(lambda *leaves: jnp.stack(leaves), *items)

  def advance(state, grad):
    if grad is not None:
      state = scaling.record_grad_amax(state, grad)
    return delayed_state.update(state, quantizer, **options)

  if delayed_state.divides_in_kernel():
    # Layers stacked by scan go to the kernel as one vector (update's leading axes), not
    # one call per layer as vmap would make them.
    recorded = (
      states
      if grads is None
      else [
        _per_layer(scaling.record_grad_amax, state, grad)
        for state, grad in zip(states, grads, strict=False)
      ]
    )
    return [delayed_state.update(state, quantizer, **options) for state in recorded]
  stacked = stack(states)
  new = _per_layer(advance, stacked, None if grads is None else stack(grads))
  return [jax.tree.map(operator.itemgetter(i), new) for i in range(len(states))]


def _advance_all(states: list, grads: list, options: dict) -> list:
  """`update_quant_state` on flat lists of RoleStates and their gradients (or Nones),
  grouped by what can share one computation."""
  groups: dict[Any, list[int]] = {}
  for i, state in enumerate(states):
    records_grad = grads[i] is not None and state.role.tensor_type == "grad_output"
    shapes = (state.scaling.amax_history.shape, state.scaling.scale.shape)
    groups.setdefault((_delayed(state.quantizer), shapes, records_grad), []).append(i)
  new = list(states)
  for (quantizer, _, records_grad), members in groups.items():
    advanced = _advance_group(
      quantizer,
      [states[i].scaling for i in members],
      [grads[i].scaling for i in members] if records_grad else None,
      options,
    )
    for i, scaled in zip(members, advanced, strict=False):
      new[i] = dataclasses.replace(states[i], scaling=scaled)
  return new


# A checkpoint of RoleStates restored without a target: plain dicts whose keys are the
# dataclasses' field names.
_UNTYPED_STATE_KEYS = ("amax_history", "scaling")


def _refuse_untyped_state(tree: Any, what: str) -> None:
  """Raises where `tree` holds a delayed-scaling state as plain dicts (a checkpoint restored
  without a target) instead of RoleStates: the helpers would see no state to advance or
  check in it, and silently do nothing."""
  for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_role_state)[0]:
    keys = [getattr(k, "key", None) for k in path]
    if any(key in _UNTYPED_STATE_KEYS for key in keys):
      raise TypeError(
        f"{what}: {jax.tree_util.keystr(path)} is a plain array in a dict, not inside a "
        "RoleState: a delayed-scaling state restored without a target (orbax's restore "
        "with no target, msgpack_restore) loses its types. Restore with the model's state "
        "as the target: orbax `checkpointer.restore(path, target)`, the target the state "
        "as initialized (`jax.eval_shape` of the init gives it without memory), or "
        "`flax.serialization.from_state_dict(target, restored)`"
      )


def _role_states_and_grads(quant_state: Any, state_grads: Any, what: str):
  """(treedef, leaves, grad leaves or Nones, the leaves' indices that are RoleStates)."""
  _refuse_untyped_state(quant_state, what)
  leaves, treedef = jax.tree.flatten(quant_state, is_leaf=is_role_state)
  if state_grads is None:
    grad_leaves = [None] * len(leaves)
  else:
    _refuse_untyped_state(state_grads, what + " (its state_grads)")
    grad_leaves = treedef.flatten_up_to(state_grads)
  at = [i for i, leaf in enumerate(leaves) if is_role_state(leaf)]  # e.g. params beside it
  return treedef, leaves, grad_leaves, at


def update_quant_state(
  quant_state: Any, state_grads: Any = None, *, finite=True, outlier_factor=None
) -> Any:
  """Advances every `RoleState` in `quant_state` by one training step.

  Args:
    quant_state: any pytree holding RoleStates (a Linen `"quant_state"` collection, an
      NNX `nnx.State` of `QuantState` variables, a quantized function's state, or a dict
      containing any of them), as the forward pass of this step left it (input and
      weight amaxes recorded).
    state_grads: the gradient of the loss with respect to the state the step started
      from, with the same structure; it carries the grad_output amaxes. None skips
      them (e.g. a forward-only calibration step).
    finite: whether the step counts (a bool or a traced bool scalar, e.g. the verdict of
      `optax.apply_if_finite`, `opt_state.last_finite`). Where False, every state comes
      back as the step found it: this step's records dropped, scale and history
      unchanged, nothing rolled (`scaling.update`).
    outlier_factor: None (off), or a number > 1: an amax recorded this step that is finite
      and more than this many times its history's max is not recorded, for one step
      (`scaling.update`, `scaling.outlier_skipped`), and a warning names its role. It
      guards against a batch whose values are far out of range but whose loss stays
      finite, which no finiteness check skips. README's train step uses 2**10.

  Returns:
    The state for the next step: the new scales, the histories rolled.

  Call it once per step. A second call on its result is a step in which nothing was
  recorded (the state cannot tell the two apart): each scale is recomputed from the same
  history and the history rolls once more, so this step's amaxes leave it one step sooner.
  """
  options = dict(finite=finite, outlier_factor=outlier_factor)
  treedef, leaves, grad_leaves, at = _role_states_and_grads(
    quant_state, state_grads, "update_quant_state"
  )
  states, grads = [leaves[i] for i in at], [grad_leaves[i] for i in at]
  if outlier_factor is not None and finite is not False and states:
    _warn_of_skipped_outliers(states, grads, finite, outlier_factor)
  advanced = _advance_all(states, grads, options)
  for i, state in zip(at, advanced, strict=False):
    leaves[i] = state
  return jax.tree.unflatten(treedef, leaves)


def _warn_of_skipped_outliers(states: list, grads: list, finite, factor) -> None:
  """Logs, from the host, each role whose amax `update` skips this step as an outlier; the
  host is called only on a step that skips one."""
  recorded = [
    _per_layer(scaling.record_grad_amax, s.scaling, g.scaling)
    if g is not None and s.role.tensor_type == "grad_output"
    else s.scaling
    for s, g in zip(states, grads, strict=True)
  ]
  skipped = [scaling.outlier_skipped(r, factor) & finite for r in recorded]
  amaxes = [r.amax_history[..., 0] for r in recorded]
  names = [f"{s.role.name} ({s.role.tensor_type})" for s in states]

  def log(skipped, amaxes):
    for name, flags, values in zip(names, skipped, amaxes, strict=True):
      flags = np.asarray(flags)
      for index in filter(lambda index: flags[index], np.ndindex(flags.shape)):
        where = f" of layer {index}" if index else ""  # scanned layers: one state each
        _log.warning(
          "jaxquant: delayed scaling skipped an outlier amax of %s%s: %g, more than %g "
          "times its history's max; not recorded this step",
          name,
          where,
          float(np.asarray(values)[index]),
          factor,
        )

  any_skipped = jnp.any(jnp.stack([jnp.any(flags) for flags in skipped]))
  jax.lax.cond(any_skipped, lambda: jax.debug.callback(log, skipped, amaxes), lambda: None)


def recorded_amaxes_finite(quant_state: Any, state_grads: Any = None) -> jax.Array:
  """Whether every amax this step recorded is finite: a bool scalar.

  The input and weight amaxes in `quant_state` (as the forward pass left it) and the
  grad_output amaxes in `state_grads` (same arguments as `update_quant_state`). An FP8
  cast saturates an inf to +-fmax, so a batch holding an inf can leave the loss and the
  gradients finite: and the step's finiteness check, AND-ed with this, skips it
  (README, "Train step").
  """
  _, leaves, grad_leaves, at = _role_states_and_grads(
    quant_state, state_grads, "recorded_amaxes_finite"
  )
  checks = [scaling.recorded_amaxes_finite(leaves[i].scaling) for i in at]
  checks += [
    scaling.recorded_amaxes_finite(grad_leaves[i].scaling)
    for i in at
    if grad_leaves[i] is not None and leaves[i].role.tensor_type == "grad_output"
  ]
  return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def combine_quant_state(a: Any, b: Any) -> Any:
  """Merges two records of one step (micro-batches, or their state gradients) by max."""
  _refuse_untyped_state(a, "combine_quant_state")
  _refuse_untyped_state(b, "combine_quant_state")
  return jax.tree.map(
    lambda x, y: dataclasses.replace(x, scaling=scaling.combine(x.scaling, y.scaling)),
    a,
    b,
    is_leaf=is_role_state,
  )

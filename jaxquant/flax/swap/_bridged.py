"""A jaxquant Linen hook bridged into NNX on its own, as MaxText's NNX layers use it.

MaxText's NNX layers (`linears.DenseGeneral`, the MoE's) take the Linen module of
`quant.dot_general_cls(...)()` / `quant.einsum(...)` and wrap it alone in a Linen-to-NNX
bridge (`ToNNX`): the hook is the root of its own `init` / `apply`, so its path is empty.
They build it in their `__init__` (`lazy_init` and a call, on a dummy input), call it with
`mutable=["aqt"]`, and MaxText's train step writes back no state of theirs but the
`_overwrite_with_gradient` collection, which it overwrites with its gradient (as Flax's
own FP8 ops use it). So such a hook:

- names its role by the path of the NNX layer calling it: the innermost NNX module running
  on the Python stack that `quantize_model` named (`_paths`), the bridge itself skipped;
  as the swap-in names a routed weight, the weight's param is found among the layer's
  (`_provenance`), so a layer's `kernel` goes by the layer's path and its other params
  by their own (the MoE's `wi_0`, `wo`).
  A layer being built has no path yet: its dummy call runs as written (MaxText throws the
  output away), and so does `init`. Any other call from an unnamed layer is an error that
  says to give the built model to `quantize_model`: a role without a name would match no
  per-layer policy, silently.
- keeps its delayed-scaling state in `_overwrite_with_gradient`, made at `init` (asking
  the recipe for the layer's path, or for the name "" while the layer is being built),
  and makes the gradient of that state its next value: the forward records the input and
  weight amaxes, the backward the grad_output amax, then `update_quant_state` advances it,
  as jaxquant's own train step does for every layer (a step counts as finite). A role the
  recipe gives delayed scaling but no state was made for is an error naming the rule; a
  step that differentiates the GEMM but not its state warns (its scales would not move).
- draws stochastic-rounding keys from the bridge's "quant" stream, else from MaxText's
  "aqt" stream.
- contracts at the calling layer's `matmul_precision` where it is handed no precision:
  MaxText's layers give their quantization `precision=None` (AQT chooses its own) and
  keep their setting for their plain `lax.dot_general`, so a GEMM the recipe leaves in
  high precision compiles as the plain model's does.

In a model whose hooks keep state in `_overwrite_with_gradient`, the GEMMs its own code makes
(MaxText's `logits_dense`, routed by `quantize_model`) keep theirs there too
(`GradientStateHost`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta
from jax import custom_derivatives

from jaxquant import recipes
from jaxquant.flax._rng import QUANT_RNG
from jaxquant.flax.swap._hosts import NnxHost, nnx_state_attr
from jaxquant.flax.swap._paths import is_linen_bridge, module_path, own_params
from jaxquant.intercept import _provenance as provenance
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._hosts import KERNEL, WeightRef, WritesBack
from jaxquant.intercept._keys import draws_key
from jaxquant.intercept._role_state import RoleState, init_role_states, update_quant_state
from jaxquant.quantizers import needs_state
from jaxquant.roles import LINEAR, gemm_roles

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # Flax's and MaxText's collection
MAXTEXT_RNG = "aqt"  # the stream MaxText's training Rngs hold for quantization
BUILDING_NAME = ""  # the role name a layer being built is asked for (it has no path yet)

# `contract(weight, lhs, rhs)`: the hook's contraction of `rhs` as `weight`, per the recipe.
Contract = Callable[[WeightRef, jax.Array, jax.Array], jax.Array]


def _state_name(tensor_type: str) -> str:
  """A state's variable name: the hook contracts one weight, its state is named as a
  kernel's whatever the layer calls the param."""
  return f"{KERNEL}_{tensor_type}"


def _calling_layer() -> tuple[Optional[nnx.Module], bool]:
  """(the calling NNX layer if `quantize_model` named it, else None; whether that layer is
  being built).

  The innermost NNX module among the `self` of the running methods, bridges skipped: a
  named one is the layer; an unnamed one whose `__init__` is running is being built."""
  frame = inspect.currentframe()
  while frame is not None:
    module = frame.f_locals.get("self")
    if isinstance(module, nnx.Module) and not is_linen_bridge(module):
      if module_path(module) is not None:
        return module, False
      if frame.f_code.co_name == "__init__":
        return None, True
    frame = frame.f_back
  return None, False


def caller_precision() -> Optional[jax.lax.Precision]:
  """The `matmul_precision` of the named NNX layer calling a bridged hook (MaxText's
  setting, e.g. "highest"), as a `lax.Precision`; None where the layer has none."""
  layer, _ = _calling_layer()
  value = None if layer is None else getattr(layer, "matmul_precision", None)
  return None if value is None else jax.lax.Precision(value)


def _weight(layer: nnx.Module, rhs, host) -> WeightRef:
  """The layer's param that `rhs` is (or was cast / viewed from), as the swap-in names a
  routed weight: its `kernel` by the layer's path (DenseGeneral), another param by its own
  path (MoE's `wi_0`); a weight the layer does not hold as a param, as its `kernel`."""
  return WeightRef(module_path(layer), provenance.find(rhs, own_params(layer)) or KERNEL, host)


def _recipe(recipe) -> recipes.CustomRecipe:
  outer = sessions.current()
  return recipes.resolve(recipe, outer.recipe if outer else None)


def _init_states(module: nn.Module, recipe, name: str) -> None:
  """The `_overwrite_with_gradient` variables of the delayed-scaling roles of `name`."""
  states = init_role_states(gemm_roles(LINEAR, name), _recipe(recipe).quantizers(LINEAR, name))
  for tensor_type, state in states.items():
    module.scope.variable(OVERWRITE_WITH_GRADIENT, _state_name(tensor_type), lambda s=state: s)


def _draw_key(module: nn.Module) -> Optional[jax.Array]:
  for stream in (QUANT_RNG, MAXTEXT_RNG):
    if module.has_rng(stream):
      return module.make_rng(stream)
  return None


@dataclasses.dataclass
class BridgedHost(WritesBack):
  """The host of a bridged hook's weight: the states and key its call was given (inputs
  of `_overwrite_with_gradient`), and the states its GEMM wrote."""

  states: dict  # {"<param>_<tensor_type>": RoleState}
  drawn_key: Optional[jax.Array]
  written: dict = dataclasses.field(default_factory=dict)

  def key(self, quantizers, what: str, optional: bool = False) -> Optional[jax.Array]:
    if not draws_key(quantizers):
      return None
    if self.drawn_key is None and not optional:
      raise ValueError(
        f"{what}: its recipe rounds stochastically, and the bridge gave the hook no "
        f"{QUANT_RNG!r} or {MAXTEXT_RNG!r} stream. MaxText keeps a layer's Rngs for its hook "
        "only where MaxTextQuantization.needs_apply_rngs is True: give MaxTextQuantization "
        "a recipe that rounds stochastically for the role name '' (the name a layer being "
        "built is asked for), or none of its own"
      )
    return self.drawn_key

  def state(self, param: str, roles, quantizers, what: str, num_groups=None) -> Optional[dict]:
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    if num_groups is not None:
      raise ValueError(
        f"{what}: a grouped (per-expert) GEMM needs one delayed-scaling state per "
        f"expert, and MaxText makes one per layer in {OVERWRITE_WITH_GRADIENT}; give "
        "this role current scaling"
      )
    missing = sorted(t for t in stateful if _state_name(t) not in self.states)
    if missing:
      raise ValueError(
        f"{what}: the recipe gives roles {missing} delayed scaling, but no state was made "
        f"for them: MaxText makes a layer's state when it builds the layer, before the "
        f"layer has a path, and the recipe gave role name {BUILDING_NAME!r} no delayed "
        "scaling there. Give role name '' the same delayed quantizers, or this role "
        "current scaling"
      )
    states = {t: self.states[_state_name(t)] for t in stateful}
    for t, state in states.items():
      if not isinstance(state, RoleState) or state.quantizer != stateful[t]:
        raise ValueError(
          f"{what}: {OVERWRITE_WITH_GRADIENT}/{_state_name(t)} holds "
          f"{getattr(state, 'quantizer', state)!r}, not a state made for {stateful[t]!r}; "
          "rebuild the model (its state is made with the layer)"
        )
    return {t: state.scaling for t, state in states.items()}

  def write_state(self, param: str, new_state: dict) -> None:
    self.written.update({_state_name(t): s for t, s in new_state.items()})


def _advanced(states: dict, written: dict, state_grads: dict) -> dict:
  """The next value of each state: advanced where the GEMM wrote it, else as it was."""
  recorded = {n: dataclasses.replace(states[n], scaling=s) for n, s in written.items()}
  new = update_quant_state(recorded, {n: state_grads[n] for n in written})
  return {n: new.get(n, state) for n, state in states.items()}


def _state_not_differentiated(role_name: str) -> str:
  return (
    f"jaxquant: the delayed-scaling GEMM of MaxText layer weight {role_name!r} was "
    "differentiated but its state was not: its scales will not advance. Its state lives "
    f"in the {OVERWRITE_WITH_GRADIENT!r} collection, whose gradient is its next value: "
    "differentiate with respect to it too and overwrite it with its gradient, as "
    "MaxText's train step does"
  )


def _primal(x):
  return x.value if isinstance(x, custom_derivatives.CustomVJPPrimal) else x


def _overwrite_with_gradient(run, operands, states: dict, role_name: str) -> jax.Array:
  """`run(operands, states)`'s output, whose gradient with respect to `states` is their
  next value (`_advanced`); `run` returns (output, the states its GEMM wrote). A step
  that differentiates the operands but not the states warns (at trace time, once per
  GEMM `role_name` of the model): the scales would stay as they are, silently."""

  @jax.custom_vjp
  def gemm(operands, states):
    return run(operands, states)[0]

  def forward(operands, states):
    perturbed = lambda tree: [p.perturbed for p in jax.tree.leaves(tree, is_leaf=_is_primal)]
    if any(perturbed(operands)) and not any(perturbed(states)):
      warning = _state_not_differentiated(role_name)
      sessions.warn_once(f"state not differentiated: {role_name}", warning)
    operands, states = jax.tree.map(_primal, (operands, states), is_leaf=_is_primal)
    y, backward, written = jax.vjp(run, operands, states, has_aux=True)
    return y, (backward, states, written)

  def backward(residuals, y_grad):
    backward, states, written = residuals
    if isinstance(y_grad, custom_derivatives.SymbolicZero):
      y_grad = jnp.zeros(y_grad.shape, y_grad.dtype)
    operand_grads, state_grads = backward(y_grad)
    return operand_grads, _advanced(states, written, state_grads)

  gemm.defvjp(forward, backward, symbolic_zeros=True)
  return gemm(operands, states)


def overwrite_with_gradient_type() -> type:
  """The NNX Variable type of the `_overwrite_with_gradient` collection (MaxText's)."""
  return nnx.variablelib.variable_type_from_name(OVERWRITE_WITH_GRADIENT, allow_register=True)


def holds_overwrite_with_gradient(model: nnx.Module) -> bool:
  """Whether `model` keeps state in `_overwrite_with_gradient` (MaxText's `quant=` hooks
  under delayed scaling), which its train step advances: its routed GEMMs' state goes
  there too (`GradientStateHost`)."""
  return bool(jax.tree.leaves(nnx.state(model, overwrite_with_gradient_type())))


@dataclasses.dataclass(frozen=True)
class GradientStateHost(NnxHost):
  """The host of a routed weight in a model whose hooks keep their state in
  `_overwrite_with_gradient` (MaxText's, built with `quant=`): its state is such a
  variable too (`<module>.<param>_quant_state`, made at the GEMM's first call), whose
  gradient is its next value, as the hooks' are: MaxText's train step differentiates the
  params and that collection, keeps them, and drops every other change of the model."""

  def variable(self, states: dict) -> nnx.Variable:
    return overwrite_with_gradient_type()(states)

  def run(self, param, gemm, operands, state):
    if state is None:
      return gemm(operands, None)[0]
    states = getattr(self.module, nnx_state_attr(param)).get_value()  # {type: RoleState}
    run = lambda operands, states: gemm(operands, {t: s.scaling for t, s in states.items()})
    role_name = WeightRef(module_path(self.module) or "", param, self).role_name
    return _overwrite_with_gradient(run, operands, states, role_name)


def _is_primal(x) -> bool:
  return isinstance(x, custom_derivatives.CustomVJPPrimal)


def contract(
  module: nn.Module, recipe, contract_fn: Contract, plain: Callable, lhs, rhs
) -> jax.Array:
  """A bridged hook's contraction of `rhs` (the weight) with `lhs` (module docstring);
  `plain(lhs, rhs)` is the contraction as written."""
  layer, building = _calling_layer()
  if module.is_initializing() or building:
    if module.is_initializing():
      name = BUILDING_NAME if layer is None else _weight(layer, rhs, None).role_name
      _init_states(module, recipe, name)
    with routing_pause.paused():  # a dummy call: nothing of it is kept
      return plain(lhs, rhs)
  if layer is None:
    raise ValueError(
      f"{type(module).__name__}: the NNX layer calling this hook has no path, so its "
      "role would have none (MaxText's NNX layers bridge the hook alone and do not know "
      "their path). Give the built model to jaxquant.flax.quantize_model(model, recipe): "
      "it names every layer, and quantizes the layers MaxText gives no quant= "
      "(logits_dense)"
    )
  # MaxText's bridge hands over variables with NNX metadata boxed (`NNXMeta`).
  states = meta.unbox(dict(module.variables.get(OVERWRITE_WITH_GRADIENT, {})))

  found = _weight(layer, rhs, None)

  def run(operands, states):
    lhs, rhs, key = operands
    weight = dataclasses.replace(found, host=BridgedHost(states, key))
    return contract_fn(weight, lhs, rhs), weight.host.written

  operands = (lhs, rhs, _draw_key(module))
  if not states:
    return run(operands, states)[0]
  return _overwrite_with_gradient(run, operands, states, found.role_name)

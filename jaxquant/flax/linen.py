"""Quantized Linen layers: Dense, DenseGeneral, Einsum.

Each subclasses Flax's layer of the same name, so constructor arguments, param names,
shapes and initializers are Flax's, and params load both ways. One more attribute,
`recipe`, is the module's own recipe (a `CustomRecipe` or a preset's name); the most
specific one wins (`recipes.resolve`): the module's, then the model's
(`jaxquant.flax.quantize_model`), then `autocast`'s.

A module's roles are named by its module path ('decoder/layer_0/mlp/wi'; a root layer's
by its weight's name, 'kernel'). When the recipe quantizes nothing for it, the layer runs
Flax's own code (bit-identical); otherwise its contraction becomes one GEMM through
`jaxquant.ops.dense`. Delayed-scaling state lives in the "quant_state" collection
(`jaxquant.flax.update_quant_state`): a call that cannot write it back (the collection
not mutable) warns, once per call site, unless it runs inside `frozen_quant_state()`
(forward-only evaluation); a state that is not a `RoleState` (a checkpoint restored
without a target) is refused, naming its path. Stochastic rounding draws its key from
the "quant" RNG stream (`apply(..., rngs={"quant": key})`).

`gemm_call` is the implementation shared with the swap-in (`jaxquant.flax.swap`), which
runs it on Flax's own nn.Dense / nn.DenseGeneral / nn.Einsum instances, and `native_call`
on these layers under the model's recipe.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import warnings
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum
from flax.core import meta

from jaxquant import recipes
from jaxquant.flax._metadata import annotate_linen_weight
from jaxquant.flax._rng import linen_key
from jaxquant.flax._state import QUANT_STATE
from jaxquant.intercept import _contraction as contraction
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._role_state import init_role_states, is_role_state
from jaxquant.ops._operands import is_high_precision
from jaxquant.quantizers import needs_state
from jaxquant.roles import LINEAR, gemm_roles

__all__ = ["Dense", "DenseGeneral", "Einsum", "frozen_quant_state"]


def module_path(module: nn.Module) -> str:
  return "/".join(module.path)


def _describe(module: nn.Module) -> str:
  return f"{type(module).__name__} {module_path(module)!r}"


# ---- Params exactly as Flax's layers create them. ----


def _dense_params(module, x):
  kernel = module.param(
    "kernel", module.kernel_init, (x.shape[-1], module.features), module.param_dtype
  )
  bias = (
    module.param("bias", module.bias_init, (module.features,), module.param_dtype)
    if module.use_bias
    else None
  )
  return kernel, bias


def _init_flat_then_reshape(init, n_rows: int):
  """DenseGeneral's initializers see the 2-D [K, N] (or 1-D [N]) shape, then reshape:
  fan-in and fan-out are those of the flattened GEMM."""

  def wrapped(rng, shape, dtype=jnp.float32):
    flat = (
      (int(np.prod(shape[:n_rows])), int(np.prod(shape[n_rows:])))
      if n_rows
      else (int(np.prod(shape)),)
    )
    value = init(rng, flat, dtype)
    if isinstance(value, meta.AxisMetadata):
      return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)

  return wrapped


# ---- The three layers' contractions, each as its kernel's shape, its plan and a function
# creating its params; the shape and plan come first, so that a GEMM its quantizers do not
# fit can still be handed to Flax's own code, which then creates the params itself. ----


@dataclasses.dataclass(frozen=True)
class _Contraction:
  kernel_shape: tuple[int, ...]
  plan: contraction.GemmPlan
  params: Callable[[], tuple]  # () -> (kernel, bias or None, add_bias(y, bias))


def _dense(module, x):
  plan = contraction.plan_dense_general(x.ndim, (x.ndim - 1,), 1)

  def params():
    kernel, bias = _dense_params(module, x)
    return kernel, bias, lambda y, b: y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))

  return _Contraction((x.shape[-1], module.features), plan, params)


def _dense_general(module, x):
  features = nn.linear._canonicalize_tuple(module.features)
  axis = nn.linear._normalize_axes(nn.linear._canonicalize_tuple(module.axis), x.ndim)
  if nn.linear._canonicalize_tuple(module.batch_dims):
    raise ValueError(
      f"{_describe(module)}: batch_dims={module.batch_dims} makes it a batched "
      "GEMM, which quantized layers do not support; map this module to None "
      "(high precision) in the recipe"
    )
  kernel_shape = tuple(x.shape[a] for a in axis) + features

  def params():
    kernel = module.param(
      "kernel",
      _init_flat_then_reshape(module.kernel_init, len(axis)),
      kernel_shape,
      module.param_dtype,
    )
    bias = (
      module.param(
        "bias", _init_flat_then_reshape(module.bias_init, 0), features, module.param_dtype
      )
      if module.use_bias
      else None
    )
    return kernel, bias, lambda y, b: y + b

  return _Contraction(
    kernel_shape, contraction.plan_dense_general(x.ndim, axis, len(features)), params
  )


def _einsum(module, x, einsum_str=None):
  einsum_str = nn.module.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise ValueError(
      f"{_describe(module)}: einsum_str must be explicit ('->') with exactly two "
      f"operands, got {einsum_str!r}"
    )
  kernel_shape = tuple(module.shape)
  operands, out, _ = opt_einsum.parser.parse_einsum_input(
    (einsum_str, x, jax.ShapeDtypeStruct(kernel_shape, module.param_dtype))
  )
  lhs, rhs = operands.split(",")

  def params():
    kernel = module.param("kernel", module.kernel_init, kernel_shape, module.param_dtype)
    if not module.use_bias:
      return kernel, None, None
    bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, x, kernel)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
    return kernel, bias, lambda y, b: y + jnp.reshape(b, broadcast_shape)

  return _Contraction(
    kernel_shape, contraction.plan_einsum(lhs, rhs, out, _describe(module)), params
  )


_CONTRACTIONS = {nn.Dense: _dense, nn.DenseGeneral: _dense_general, nn.Einsum: _einsum}


def _flax_class(module) -> type:
  for cls in type(module).__mro__:
    if cls in _CONTRACTIONS:
      return cls
  raise TypeError(f"{type(module).__name__} is not a Flax Dense, DenseGeneral or Einsum")


# ---- Delayed-scaling state: checked when read, written back only where it can be. ----

_FROZEN: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "jaxquant_frozen_quant_state", default=False
)
# Frames of these packages lie between the user's code and a GEMM's state write.
_LIBRARIES = frozenset({"jaxquant", "flax", "jax", "jaxlib", "contextlib"})
_STATE_DROPPED = (
  "jaxquant: a delayed-scaling GEMM ran with the "
  f"{QUANT_STATE!r} collection immutable: this call's amaxes are dropped and its scales "
  "will not advance. To train, apply the model with "
  f"mutable=[{QUANT_STATE!r}] and pass the returned state to "
  "jaxquant.flax.update_quant_state each step; to evaluate forward-only with the stored "
  "scales, run it inside jaxquant.flax.linen.frozen_quant_state()"
)


@contextlib.contextmanager
def frozen_quant_state():
  """Forward-only evaluation of delayed-scaling Linen modules (jaxquant's layers and the
  swap-in's): within this context (this thread / task), their GEMMs quantize with the
  stored scales and write nothing back, even where the "quant_state" collection is
  mutable, and without the warning that a call with the collection immutable gives
  elsewhere (its amaxes would be silently lost to training)."""
  token = _FROZEN.set(True)
  try:
    yield
  finally:
    _FROZEN.reset(token)


def _caller_stacklevel() -> int:
  """The stacklevel, for a warning raised by this function's caller, of the first frame
  outside jaxquant, Flax and JAX: the model code that called the layer, so that the
  warning is shown once per call site."""
  level, frame = 1, sys._getframe(1)
  while frame.f_back is not None and (
    frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES
  ):
    frame, level = frame.f_back, level + 1
  return level


def checked_states(variables: dict, stateful: dict, what: str) -> dict:
  """{tensor_type: DelayedScalingState} of a GEMM's quant_state `variables` ({tensor_type:
  Linen variable}), after checking each holds a `RoleState` made for `stateful[type]`."""
  for t, v in variables.items():
    where = "/".join((QUANT_STATE, *v.scope.path, v.name))
    if not is_role_state(v.value):
      raise TypeError(
        f"{what}: {where} holds a {type(v.value).__name__}, not a jaxquant.flax.RoleState; "
        "a checkpoint restored without a target gives plain dicts. Restore it with the "
        "model's state as the target (the variables of model.init, or the state that "
        "was saved): orbax's checkpointer.restore(path, args=ocp.args.StandardRestore("
        "target)), or restore(path, item=target)"
      )
    if v.value.quantizer != stateful[t]:
      raise ValueError(
        f"{what}: {where} was made for {v.value.quantizer!r} but the recipe now gives "
        f"{stateful[t]!r}; re-initialise the {QUANT_STATE} collection"
      )
  return {t: v.value.scaling for t, v in variables.items()}


def write_states(module: nn.Module, variables: dict, new_state: dict) -> None:
  """Stores a GEMM's new delayed-scaling state in its quant_state `variables`; not at init
  nor under `frozen_quant_state`. With the collection immutable (a plain `apply`), the
  state is dropped and a warning says so, once per call site."""
  if module.is_initializing() or _FROZEN.get():
    return
  if not module.is_mutable_collection(QUANT_STATE):
    warnings.warn(_STATE_DROPPED, UserWarning, stacklevel=_caller_stacklevel())
    return
  for t, v in variables.items():
    v.value = dataclasses.replace(v.value, scaling=new_state[t])


def _state_variables(module, roles, quantizers):
  """The module's quant_state variables, created for exactly the delayed-scaling roles."""
  stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
  if not stateful:
    return {}, None
  fresh = lambda t: init_role_states(roles, quantizers)[t]
  variables = {t: module.variable(QUANT_STATE, t, fresh, t) for t in stateful}
  return variables, checked_states(variables, stateful, _describe(module))


def role_name(module: nn.Module) -> str:
  """The name of a layer's roles: its module path; the root layer's, its weight's name
  ("kernel"), so that a policy can tell it apart."""
  return module_path(module) or "kernel"


def gemm_call(
  module: nn.Module,
  flax_call: Callable,
  args,
  kwargs,
  *,
  model_recipe: Optional[recipes.CustomRecipe],
  annotate: bool,
):
  """Runs a (Flax or jaxquant) Dense / DenseGeneral / Einsum under the resolved recipe.

  Args:
    module: the bound layer; its attributes and params are used as they are.
    flax_call: Flax's own computation, `flax_call(*args, **kwargs)`, used when nothing
      is quantized so the result is bit-identical.
    model_recipe: the recipe of the whole model, if any (the module's own wins).
    annotate: box the weight with its role (`metadata.QuantizedWeight`) during init.

  A tiny GEMM (`_contraction.tiny_reason`) runs Flax's code when the recipe keeps such
  GEMMs in high precision (every preset does). Under a swap-in session
  (`jaxquant.intercept._session`) the layer is recorded for the report, and a shape its
  quantizers do not fit runs Flax's code when the session's `on_unfit` is
  "high_precision".
  """
  name = role_name(module)
  recipe = recipes.resolve(getattr(module, "recipe", None), model_recipe)
  roles = gemm_roles(LINEAR, name)
  quantizers = recipe.quantizers(LINEAR, name)
  session = sessions.current()
  record = lambda status, shapes: (
    session
    and session.record(
      sessions.Row(module_path(module), type(module).__name__, shapes, name, quantizers, status)
    )
  )
  with sessions.param_contraction_scope():
    if is_high_precision(quantizers):
      y = flax_call(*args, **kwargs)
      record(sessions.RECIPE_NONE, (np.shape(args[0]),))
    else:
      y = _quantized_call(module, recipe, roles, quantizers, flax_call, record, *args, **kwargs)
  if annotate:
    annotate_linen_weight(module, "kernel", roles["weight"], quantizers["weight"])
  return y


def _quantized_call(module, recipe, roles, quantizers, flax_call, record, x, *args, **kwargs):
  what = _describe(module)
  if (
    getattr(module, "dot_general", None) is not None
    or getattr(module, "dot_general_cls", None) is not None
  ):
    raise ValueError(
      f"{what}: a custom dot_general cannot be combined with a quantizing "
      "recipe; map this module to None in the recipe"
    )
  layer = _CONTRACTIONS[_flax_class(module)](module, x, *args, **kwargs)
  shapes = (np.shape(x), layer.kernel_shape)
  session = sessions.current()
  m, k, n = layer.plan.dims(x.shape, layer.kernel_shape)
  tiny = contraction.tiny_status(k, n, quantizers, recipe)
  if tiny:
    record(tiny, shapes)  # Flax's code creates the params, as below
    return flax_call(x, *args, **kwargs)
  if session is not None and session.on_unfit == "high_precision":
    reason = contraction.unfit_reason(m, k, n, quantizers, backward=recipe.backward)
    if reason:
      # Flax's code creates the params (none exist yet): the plain layer's bits.
      record(sessions.unfit_status(reason), shapes)
      return flax_call(x, *args, **kwargs)
  kernel, bias, add_bias = layer.params()
  layer_input = x
  x, kernel, bias = module.promote_dtype(x, kernel, bias, dtype=module.dtype)
  variables, state = _state_variables(module, roles, quantizers)
  gather = None
  if session is not None and session.weight_gather is not None:
    gather = session.weight_gather.kernel_gather(
      tuple(module.path) + ("kernel",),
      layer.kernel_shape,
      layer.plan.kernel_perm,
      layer.plan.n_contracted,
      what,
    )
  y, new_state = contraction.quantized_gemm(
    layer.plan,
    x,
    kernel,
    quantizers=quantizers,
    backward=recipe.backward,
    name=roles["weight"].name,
    what=what,
    key=linen_key(module, quantizers, what, optional=True),
    state=state,
    weight_gather=gather,
    fast_accumulation=recipe.fast_accumulation,
    shard_scaling=None if session is None else session.shard_scaling,
    layer_input=layer_input,
  )
  record(sessions.QUANTIZED, shapes)
  if variables:
    write_states(module, variables, new_state)
  return y if bias is None else add_bias(y, bias)


def native_call(module, *args, model_recipe=None, **kwargs):
  """A jaxquant Dense / DenseGeneral / Einsum's call, under `model_recipe` unless it has its own."""
  flax_call = _flax_class(module).__call__.__wrapped__
  return gemm_call(
    module,
    lambda *a, **k: flax_call(module, *a, **k),
    args,
    kwargs,
    model_recipe=model_recipe,
    annotate=True,
  )


class Dense(nn.Dense):
  """`nn.Dense` with quantized GEMMs; `recipe` overrides the model's and autocast's."""

  recipe: Optional[recipes.CustomRecipe] = None

  @nn.compact
  def __call__(self, inputs):
    return native_call(self, inputs)


class DenseGeneral(nn.DenseGeneral):
  """`nn.DenseGeneral` (without batch_dims when quantized) with quantized GEMMs."""

  recipe: Optional[recipes.CustomRecipe] = None

  @nn.compact
  def __call__(self, inputs):
    return native_call(self, inputs)


class Einsum(nn.Einsum):
  """`nn.Einsum` whose contraction is a GEMM (no batch axes when quantized)."""

  recipe: Optional[recipes.CustomRecipe] = None

  @nn.compact
  def __call__(self, inputs, einsum_str: Optional[str] = None):
    return native_call(self, inputs, einsum_str=einsum_str)


QUANTIZED_MODULES = (Dense, DenseGeneral, Einsum)

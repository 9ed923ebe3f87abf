"""Quantized Linen layers: Dense, DenseGeneral, Einsum.

Each subclasses Flax's layer of the same name, so constructor arguments, param names,
shapes and initializers are Flax's, and params load both ways. One more attribute,
`recipe`, is the module's own recipe; the most specific one wins (`recipes.resolve`):
the module's, then the model's (`jaxquant.flax.quantize_model`), then `autocast`'s.

A module's roles are named by its module path ('decoder/layer_0/mlp/wi'). When the
recipe quantizes nothing for it, the layer runs Flax's own code (bit-identical);
otherwise its contraction becomes one GEMM through `jaxquant.ops.dense`. Delayed-scaling
state lives in the "quant_state" collection (`jaxquant.flax.update_quant_state`);
stochastic rounding draws its key from the "quant" RNG stream (`apply(..., rngs={"quant":
key})`).

`gemm_call` is the implementation shared with the swap-in (`jaxquant.flax.swap`), which
runs it on Flax's own nn.Dense / nn.DenseGeneral / nn.Einsum instances, and `native_call`
on these layers under the model's recipe.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import opt_einsum
from flax.core import meta

from jaxquant import recipes
from jaxquant.flax import _contraction as contraction
from jaxquant.flax import _session as sessions
from jaxquant.flax._metadata import annotate_linen_weight
from jaxquant.flax._rng import linen_key
from jaxquant.flax._state import QUANT_STATE, init_role_states
from jaxquant.ops._operands import is_high_precision
from jaxquant.quantizers import needs_state
from jaxquant.roles import LINEAR, gemm_roles

__all__ = ["Dense", "DenseGeneral", "Einsum"]


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


# ---- The three layers' contractions, each as (params, plan) for a quantized GEMM. ----


def _dense(module, x):
  kernel, bias = _dense_params(module, x)
  plan = contraction.plan_dense_general(x.ndim, (x.ndim - 1,), 1)
  return kernel, bias, plan, lambda y, b: y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,))


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
  kernel = module.param(
    "kernel",
    _init_flat_then_reshape(module.kernel_init, len(axis)),
    kernel_shape,
    module.param_dtype,
  )
  bias = (
    module.param("bias", _init_flat_then_reshape(module.bias_init, 0), features, module.param_dtype)
    if module.use_bias
    else None
  )
  plan = contraction.plan_dense_general(x.ndim, axis, len(features))
  return kernel, bias, plan, lambda y, b: y + b


def _einsum(module, x, einsum_str=None):
  einsum_str = nn.module.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise ValueError(
      f"{_describe(module)}: einsum_str must be explicit ('->') with exactly two "
      f"operands, got {einsum_str!r}"
    )
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  operands, out, _ = opt_einsum.parser.parse_einsum_input((einsum_str, x, kernel))
  lhs, rhs = operands.split(",")
  bias = None
  if module.use_bias:
    bias_shape, broadcast_shape = module._get_bias_shape(einsum_str, x, kernel)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  plan = contraction.plan_einsum(lhs, rhs, out, _describe(module))
  return kernel, bias, plan, lambda y, b: y + jnp.reshape(b, broadcast_shape)


_CONTRACTIONS = {nn.Dense: _dense, nn.DenseGeneral: _dense_general, nn.Einsum: _einsum}


def _flax_class(module) -> type:
  for cls in type(module).__mro__:
    if cls in _CONTRACTIONS:
      return cls
  raise TypeError(f"{type(module).__name__} is not a Flax Dense, DenseGeneral or Einsum")


def _state_variables(module, roles, quantizers):
  """The module's quant_state variables, created for exactly the delayed-scaling roles."""
  stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
  if not stateful:
    return {}
  fresh = lambda t: init_role_states(roles, quantizers)[t]
  variables = {t: module.variable(QUANT_STATE, t, fresh, t) for t in stateful}
  for t, v in variables.items():
    if v.value.quantizer != stateful[t]:
      raise ValueError(
        f"{_describe(module)}: its {QUANT_STATE} for {t!r} was made for {v.value.quantizer!r} "
        f"but the recipe now gives {stateful[t]!r}; re-initialise the {QUANT_STATE} collection"
      )
  return variables


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

  Under a swap-in session (`jaxquant.flax._session`) the layer is recorded for the
  report, and a shape its quantizers do not fit runs Flax's code when the session's
  `on_unfit` is "high_precision".
  """
  name = module_path(module)
  recipe = recipes.resolve(getattr(module, "recipe", None), model_recipe)
  roles = gemm_roles(LINEAR, name)
  quantizers = recipe.quantizers(LINEAR, name)
  session = sessions.current()
  record = lambda status, shapes: (
    session
    and session.record(sessions.Row(name, type(module).__name__, shapes, name, quantizers, status))
  )
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
  kernel, bias, plan, add_bias = _CONTRACTIONS[_flax_class(module)](module, x, *args, **kwargs)
  shapes = (np.shape(x), np.shape(kernel))
  session = sessions.current()
  if session is not None and session.on_unfit == "high_precision":
    reason = contraction.unfit_reason(
      *plan.dims(x.shape, kernel.shape), quantizers, backward=recipe.backward
    )
    if reason:
      record(sessions.unfit_status(reason), shapes)
      return flax_call(x, *args, **kwargs)
  x, kernel, bias = module.promote_dtype(x, kernel, bias, dtype=module.dtype)
  variables = _state_variables(module, roles, quantizers)
  state = {t: v.value.scaling for t, v in variables.items()} or None
  gather = None
  if session is not None and session.weight_gather is not None:
    gather = session.weight_gather.kernel_gather(
      tuple(module.path) + ("kernel",), np.shape(kernel), plan.kernel_perm, plan.n_contracted, what
    )
  y, new_state = contraction.quantized_gemm(
    plan,
    x,
    kernel,
    quantizers=quantizers,
    backward=recipe.backward,
    name=module_path(module),
    what=what,
    key=linen_key(module, quantizers, what),
    state=state,
    weight_gather=gather,
    fast_accumulation=recipe.fast_accumulation,
  )
  record(sessions.QUANTIZED, shapes)
  if variables and module.is_mutable_collection(QUANT_STATE) and not module.is_initializing():
    for t, v in variables.items():
      v.value = dataclasses.replace(v.value, scaling=new_state[t])
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

"""Quantized NNX layers: Linear, Einsum.

Each subclasses Flax's layer of the same name (same constructor arguments, Params and
initializers), plus keyword-only `recipe` (the module's own, a `CustomRecipe` or a
preset's name; it wins over the model's and autocast's), `name` (the role name;
`quantize_model` sets it to the module path) and `quant_rngs` (an `nnx.Rngs` whose
"quant" stream keys stochastic rounding).

Delayed-scaling state is a `QuantState` Variable, `<module>.quant_state`, holding
{tensor_type: RoleState} for exactly the roles that need it. It is created when the
module learns its recipe and path (construction with both, or `quantize_model`): NNX
state must exist before a jitted step uses it.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import opt_einsum
from flax import nnx

from jaxquant import recipes
from jaxquant.flax._metadata import nnx_weight_metadata
from jaxquant.flax._rng import layer_index, nnx_key
from jaxquant.flax._state import QuantState
from jaxquant.intercept import _contraction as contraction
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._keys import draws_key
from jaxquant.intercept._role_state import init_role_states, is_role_state, stacked_role_states
from jaxquant.ops._operands import is_high_precision
from jaxquant.quantizers import needs_state
from jaxquant.roles import LINEAR, gemm_roles

__all__ = ["Linear", "Einsum"]


def held_states(module: nnx.Module, quantizers, what: str) -> Optional[dict]:
  """{tensor_type: DelayedScalingState} of `module.quant_state` for the delayed-scaling
  quantizers (None without any), after checking that each is a `RoleState` made for
  its quantizer (the module makes them when it learns its recipe: `bind_role`)."""
  stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
  if not stateful:
    return None
  held = module.quant_state.get_value() if hasattr(module, "quant_state") else {}
  for t, state in held.items():
    if not is_role_state(state):
      raise TypeError(
        f"{what}: its quant_state[{t!r}] holds a {type(state).__name__}, not a "
        "jaxquant.flax.RoleState; a checkpoint restored without a target gives plain "
        "dicts. Restore it with the model's state as the target (nnx.state(model) of "
        "the model built as it was saved): orbax's checkpointer.restore(path, "
        "args=ocp.args.StandardRestore(target)), or restore(path, item=target)"
      )
  for t, q in stateful.items():
    if t not in held or held[t].quantizer != q:
      raise ValueError(
        f"{what}: the recipe gives {t!r} the delayed-scaling quantizer {q!r}, but "
        "the module holds no state made for it; give the recipe to the module or to "
        "jaxquant.flax.quantize_model (not only to autocast), which create the state"
      )
  return {t: held[t].scaling for t in stateful}


def write_held_states(module: nnx.Module, new_state: dict) -> None:
  """Stores a GEMM's new delayed-scaling state in `module.quant_state`."""
  held = module.quant_state.get_value()
  module.quant_state.set_value(
    {
      t: s if t not in new_state else type(s)(new_state[t], s.role, s.quantizer)
      for t, s in held.items()
    }
  )


class _QuantizedGemm:
  """What Linear and Einsum share: recipe resolution, state, keys, the GEMM call."""

  def _init_quantization(self, recipe, name, quant_rngs):
    # A preset's name becomes its recipe; what is no recipe is refused at construction.
    self.recipe = None if recipe is None else recipes.resolve(recipe)
    self.model_recipe = None
    self.role_name = name
    self.quant_rngs = nnx.data(quant_rngs)  # data even while None
    if name is not None:
      self.bind_role(name, None)

  def bind_role(
    self, name: str, model_recipe: Optional[recipes.CustomRecipe], *, annotate: bool = True
  ) -> None:
    """Names the roles, records the model's recipe, creates the state the recipe needs."""
    self.role_name = name
    self.model_recipe = model_recipe
    quantizers = self._resolve()[1]
    roles = gemm_roles(LINEAR, name)
    stateful = {t: q for t, q in quantizers.items() if needs_state(q)}
    if stateful:
      # A layer built under nnx.vmap (layers for nnx.scan) has stacked kernels: its state
      # is stacked alike, one per layer.
      self.quant_state = QuantState(
        stacked_role_states(init_role_states(roles, quantizers), self._stacked_dims())
      )
    elif hasattr(self, "quant_state"):
      del self.quant_state
    # Layers stacked by nnx.vmap share their role name and their call's key: each folds
    # in its own index, which nnx.scan / nnx.vmap hand it.
    if self._stacked_dims() and draws_key(quantizers):
      self.quant_layer_index = layer_index(self._stacked_dims())
    elif hasattr(self, "quant_layer_index"):
      del self.quant_layer_index
    if annotate:
      self.kernel.set_metadata(**nnx_weight_metadata(roles["weight"], quantizers["weight"]))

  def _stacked_dims(self) -> tuple[int, ...]:
    """Leading kernel dims beyond the layer's own (from nnx.vmap), e.g. (layers,)."""
    own = len(self.kernel_shape) if isinstance(self, nnx.Einsum) else 2
    return tuple(self.kernel.shape[: len(self.kernel.shape) - own])

  def _what(self) -> str:
    return f"{type(self).__name__} {self.role_name!r}"

  def _resolve(self):
    recipe = recipes.resolve(self.recipe, self.model_recipe)
    return recipe, recipe.quantizers(LINEAR, self.role_name or "")

  def _state(self, quantizers):
    return held_states(self, quantizers, self._what())

  def _key(self, quantizers):
    return nnx_key(
      self.quant_rngs,
      quantizers,
      self._what(),
      "quant_rngs=nnx.Rngs(quant=seed) (or rngs= to quantize_model)",
      getattr(self, "quant_layer_index", None),
      optional=True,  # ops.dense asks for it where it rounds (a forward alone may not)
    )

  def _gemm(self, flax_call, plan_fn, inputs, *args, **kwargs):
    # Its own contraction is this layer's business: not routed, and a weight GEMM.
    with routing_pause.paused(), sessions.param_contraction_scope():
      return self._gemm_unrouted(flax_call, plan_fn, inputs, *args, **kwargs)

  def _gemm_unrouted(self, flax_call, plan_fn, inputs, *args, **kwargs):
    recipe, quantizers = self._resolve()
    session = sessions.current()
    shapes = (jnp.shape(inputs), self.kernel.shape)
    record = lambda status: (
      session
      and session.record(
        sessions.Row(
          self.role_name or "",
          type(self).__name__,
          shapes,
          self.role_name or "",
          quantizers,
          status,
        )
      )
    )
    if is_high_precision(quantizers):
      record(sessions.RECIPE_NONE)
      return flax_call(self, inputs, *args, **kwargs)
    plan, add_bias = plan_fn(inputs, *args, **kwargs)
    m, k, n = plan.dims(inputs.shape, self.kernel.shape)
    tiny = contraction.tiny_status(k, n, quantizers, recipe)
    if tiny:
      record(tiny)
      return flax_call(self, inputs, *args, **kwargs)
    if session is not None and session.on_unfit == "high_precision":
      reason = contraction.unfit_reason(m, k, n, quantizers, backward=recipe.backward)
      if reason:
        record(sessions.unfit_status(reason))
        return flax_call(self, inputs, *args, **kwargs)
    bias = self.bias[...] if self.bias is not None else None
    x, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
    state = self._state(quantizers)
    y, new_state = contraction.quantized_gemm(
      plan,
      x,
      kernel,
      quantizers=quantizers,
      backward=recipe.backward,
      name=self.role_name or "",
      what=self._what(),
      key=self._key(quantizers),
      state=state,
      fast_accumulation=recipe.fast_accumulation,
      layer_input=inputs,
    )
    record(sessions.QUANTIZED)
    if new_state is not None:
      write_held_states(self, new_state)
    return y if bias is None else add_bias(y, bias)


class Linear(_QuantizedGemm, nnx.Linear):
  """`nnx.Linear` with quantized GEMMs."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    recipe: Optional[recipes.CustomRecipe] = None,
    name: Optional[str] = None,
    quant_rngs: Optional[nnx.Rngs] = None,
    **kwargs,
  ):
    super().__init__(in_features, out_features, **kwargs)
    self._init_quantization(recipe, name, quant_rngs)

  def __call__(self, inputs, out_sharding=None):
    if out_sharding is not None:
      return nnx.Linear.__call__(self, inputs, out_sharding)

    def plan(x):
      return (
        contraction.plan_dense_general(x.ndim, (x.ndim - 1,), 1),
        lambda y, b: y + jnp.reshape(b, (1,) * (y.ndim - 1) + (-1,)),
      )

    return self._gemm(nnx.Linear.__call__, plan, inputs)


class Einsum(_QuantizedGemm, nnx.Einsum):
  """`nnx.Einsum` whose contraction is a GEMM (no batch axes when quantized)."""

  def __init__(
    self,
    einsum_str: str,
    kernel_shape,
    bias_shape=None,
    *,
    recipe: Optional[recipes.CustomRecipe] = None,
    name: Optional[str] = None,
    quant_rngs: Optional[nnx.Rngs] = None,
    **kwargs,
  ):
    super().__init__(einsum_str, kernel_shape, bias_shape, **kwargs)
    self._init_quantization(recipe, name, quant_rngs)

  def __call__(self, inputs, einsum_str: Optional[str] = None, out_sharding=None):
    if out_sharding is not None:
      return nnx.Einsum.__call__(self, inputs, einsum_str, out_sharding)

    def plan(x, einsum_str=None):
      equation = (einsum_str or self.einsum_str).replace(" ", "")
      kernel = self.kernel[...]
      operands, out, _ = opt_einsum.parser.parse_einsum_input((equation, x, kernel))
      lhs, rhs = operands.split(",")
      broadcast = self._infer_broadcasted_bias_shape(equation, x, kernel)
      return (
        contraction.plan_einsum(lhs, rhs, out, self._what()),
        lambda y, b: y + jnp.reshape(b, broadcast),
      )

    return self._gemm(nnx.Einsum.__call__, plan, inputs, einsum_str=einsum_str)


QUANTIZED_MODULES = (Linear, Einsum)

"""GroupedDense for Linen and NNX: one [G, K, N] weight parameter for all experts.

The weight carries its role (module_type "grouped_linear", tensor_type "weight", the
module path as name) through `jaxquant.flax._metadata` (a `QuantizedWeight` box in Linen, Param
metadata in NNX), so `weight_roles` lists it like any dense kernel. The call is
`ops.grouped_dense`. The bias, when used, is [G, N] (one per expert).

The recipe resolves like the dense layers': the module's own, then the model's
(`quantize_model` passes it: `linen_call(..., model_recipe=)` from its interceptor,
`NnxGroupedDense.bind_role` in NNX), then autocast's. Under the swap-in each call is a
row of its report; as for the dense layers, a tiny GEMM runs in high precision where the
recipe keeps those there (the presets do), and a kernel whose K or N the quantizers do
not tile raises, or runs in high precision with `on_unfit="high_precision"`.

Delayed scaling keeps one state per expert (`ops.grouped_dense`'s: a leading [G] axis),
where a dense layer keeps its one: in Linen at `quant_state/<module path>/<tensor_type>`,
made at `init`; in NNX a `QuantState` at `<module>.quant_state`, made when the module learns
its recipe and name (construction, `quantize_model`). A GEMM the recipe keeps in high
precision (tiny, or unfit) holds none. `update_quant_state` advances them per expert, like
stacked layers'. Stochastic rounding draws its key from the "quant" RNG stream, like the
dense layers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxquant import recipes
from jaxquant.flax._metadata import annotate_linen_weight, nnx_weight_metadata
from jaxquant.flax._rng import linen_key, nnx_key
from jaxquant.flax._state import QUANT_STATE, QuantState
from jaxquant.flax.linen import checked_states, write_states
from jaxquant.flax.nnx import held_states, write_held_states
from jaxquant.intercept import _contraction as contraction
from jaxquant.intercept import _routing_pause as routing_pause
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._keys import draws_key, without_key
from jaxquant.intercept._role_state import init_grouped_role_states
from jaxquant.ops import grouped_dense
from jaxquant.ops._operands import is_high_precision
from jaxquant.quantizers import needs_state
from jaxquant.roles import GROUPED_LINEAR, gemm_roles

default_kernel_init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))


def _quantizers(recipe, model_recipe, name):
  recipe = recipes.resolve(recipe, model_recipe)
  return recipe, recipe.quantizers(GROUPED_LINEAR, name)


def _quantizes(recipe, quantizers, k: int, n: int) -> bool:
  """Whether a [G, K, N] kernel's GEMM runs quantized: neither high precision by the
  recipe, nor kept there as tiny, nor unfit (which raises or runs in high precision)."""
  return not (
    is_high_precision(quantizers)
    or contraction.tiny_status(k, n, quantizers, recipe)
    or contraction.unfit_reason(0, k, n, quantizers, backward=recipe.backward)
  )


def _grouped_gemm(x, kernel, group_sizes, bias, **kwargs):
  """`_weight_gemm` in the scope of met contractions (`_session.param_contraction_scope`)."""
  with sessions.param_contraction_scope():
    return _weight_gemm(x, kernel, group_sizes, bias, **kwargs)


def _weight_gemm(
  x, kernel, group_sizes, bias, *, recipe, quantizers, name, path, call, key, state, what
):
  """`ops.grouped_dense` per the quantizers, recorded in the swap-in's session if any.

  A tiny GEMM (`_contraction.tiny_reason`) runs in high precision when the recipe keeps
  such GEMMs there (every preset does). A kernel whose K or N the quantizers' blocks do
  not tile (each group's M is padded to the blocks) raises `_contraction.unfit_error`, or
  runs in high precision under a session with `on_unfit="high_precision"`. `key()` draws
  the stochastic-rounding key only for a GEMM that quantizes (None without a stream:
  `without_key`); `state` holds its per-expert delayed-scaling state, read and written
  only by a GEMM that quantizes (`_LinenStates`, `_NnxStates`)."""
  session = sessions.current()
  record = lambda status: (
    session
    and session.record(
      sessions.Row(path, call, (np.shape(x), np.shape(kernel)), name, quantizers, status)
    )
  )
  if is_high_precision(quantizers):
    record(sessions.RECIPE_NONE)
    return grouped_dense(x, kernel, group_sizes, bias, recipe=recipe, name=name)
  _, k, n = np.shape(kernel)
  high_precision = lambda: grouped_dense(
    x, kernel, group_sizes, bias, recipe=recipes.bf16, name=name
  )
  tiny = contraction.tiny_status(k, n, quantizers, recipe)
  if tiny:
    record(tiny)
    return high_precision()
  # ops.grouped_dense checks the weight's backward usages even for a forward only.
  reason = contraction.unfit_reason(0, k, n, quantizers, backward=recipe.backward)
  if reason and (session is None or session.on_unfit == "error"):
    raise contraction.unfit_error(what, reason, name)
  if reason:
    record(sessions.unfit_status(reason))
    return high_precision()
  record(sessions.QUANTIZED)

  def run(operands, key):
    *operands, held = operands
    out = grouped_dense(*operands, recipe=recipe, name=name, key=key, state=held)
    return (out, None) if held is None else out

  operands = (x, kernel, group_sizes, bias, state.read())
  drawn = key()
  if drawn is None:
    y, new_state = without_key(run, operands, quantizers, what)
  else:
    y, new_state = run(operands, drawn)
  if new_state is not None:
    state.write(new_state)
  return y


class _LinenStates:
  """A Linen GroupedDense's per-expert states, in its "quant_state" collection at
  `<tensor_type>` (a dense layer's place), made at `init`."""

  def __init__(self, module: nn.Module, quantizers, name: str, num_groups: int, what: str):
    self.module, self.quantizers, self.what = module, quantizers, what
    self.roles, self.num_groups = gemm_roles(GROUPED_LINEAR, name), num_groups
    self.variables = {}

  def read(self) -> Optional[dict]:
    stateful = {t: q for t, q in self.quantizers.items() if needs_state(q)}
    if not stateful:
      return None
    fresh = lambda t: init_grouped_role_states(self.roles, self.quantizers, self.num_groups)[t]
    self.variables = {t: self.module.variable(QUANT_STATE, t, fresh, t) for t in stateful}
    return checked_states(self.variables, stateful, self.what)

  def write(self, new_state: dict) -> None:
    write_states(self.module, self.variables, new_state)


class GroupedDense(nn.Module):
  """Linen: y[m] = x[m] @ kernel[g(m)] (+ bias[g(m)]), rows of x grouped by `group_sizes`."""

  num_groups: int
  features: int
  use_bias: bool = False
  recipe: Optional[recipes.CustomRecipe] = None
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x, group_sizes):
    return linen_call(self, x, group_sizes)


def linen_call(
  module: GroupedDense, x, group_sizes, *, model_recipe: Optional[recipes.CustomRecipe] = None
):
  """GroupedDense's computation, under the model's recipe unless the module has its own."""
  path = "/".join(module.path)
  name = path or "kernel"  # the root layer's roles by its weight's name
  what = f"GroupedDense {path!r}"
  recipe, quantizers = _quantizers(module.recipe, model_recipe, name)
  session = sessions.current()
  if session is not None and session.weight_gather is not None and quantizers["weight"] is not None:
    raise ValueError(
      f"{what}: quantize_model's weight_gather does not reach grouped (MoE) "
      "layers, whose experts' kernels would be gathered in high precision; "
      "leave weight_gather out"
    )
  if session is not None and session.shard_scaling is not None and quantizers["input"] is not None:
    raise ValueError(
      f"{what}: quantize_model's shard_scaling scales the rows of dense layers per "
      "shard; a grouped (MoE) layer's rows are its experts' tokens, which it does not "
      "take. Leave shard_scaling out"
    )
  kernel = module.param(
    "kernel",
    module.kernel_init,
    (module.num_groups, x.shape[-1], module.features),
    module.param_dtype,
  )
  annotate_linen_weight(
    module, "kernel", gemm_roles(GROUPED_LINEAR, name)["weight"], quantizers["weight"]
  )
  bias = (
    module.param("bias", module.bias_init, (module.num_groups, module.features), module.param_dtype)
    if module.use_bias
    else None
  )
  return _grouped_gemm(
    x,
    kernel,
    group_sizes,
    bias,
    recipe=recipe,
    quantizers=quantizers,
    name=name,
    path=path,
    call=type(module).__name__,
    key=lambda: linen_key(module, quantizers, what, optional=True),
    state=_LinenStates(module, quantizers, name, module.num_groups, what),
    what=what,
  )


class NnxGroupedDense(nnx.Module):
  """NNX: the same layer; `name` names its roles (NNX modules do not know their path;
  `quantize_model` sets it to the module path)."""

  def __init__(
    self,
    in_features: int,
    out_features: int,
    num_groups: int,
    *,
    use_bias: bool = False,
    recipe: Optional[recipes.CustomRecipe] = None,
    name: str = "",
    param_dtype=jnp.float32,
    kernel_init=default_kernel_init,
    rngs: nnx.Rngs,
  ):
    self.kernel = nnx.Param(
      kernel_init(rngs.params(), (num_groups, in_features, out_features), param_dtype)
    )
    self.bias = nnx.Param(jnp.zeros((num_groups, out_features), param_dtype)) if use_bias else None
    # A preset's name becomes its recipe; what is no recipe is refused at construction.
    self.recipe = None if recipe is None else recipes.resolve(recipe)
    self.model_recipe, self.name = None, name
    quantizers = self._resolve()[1]
    # The module's own stochastic-rounding recipe draws from `rngs`; a model recipe's
    # from the rngs given to `quantize_model`.
    self.quant_rngs = nnx.data(rngs if draws_key(quantizers) else None)
    self.bind_role(name, None)

  def bind_role(self, name: str, model_recipe: Optional[recipes.CustomRecipe]) -> None:
    """Names the roles, records the model's recipe (the module's own still wins), and
    creates the per-expert state its GEMM needs (none where it is not quantized)."""
    self.name, self.model_recipe = name, model_recipe
    recipe, quantizers = self._resolve()
    roles = gemm_roles(GROUPED_LINEAR, name)
    num_groups, k, n = self.kernel.shape
    stateful = any(needs_state(q) for q in quantizers.values())
    if stateful and _quantizes(recipe, quantizers, k, n):
      self.quant_state = QuantState(init_grouped_role_states(roles, quantizers, num_groups))
    elif hasattr(self, "quant_state"):
      del self.quant_state
    self.kernel.set_metadata(**nnx_weight_metadata(roles["weight"], quantizers["weight"]))

  def _resolve(self):
    return _quantizers(self.recipe, self.model_recipe, self.name)

  def _key(self, quantizers):
    return nnx_key(
      self.quant_rngs,
      quantizers,
      f"GroupedDense {self.name!r}",
      "rngs= to quantize_model (an nnx.Rngs with a 'quant' stream)",
      optional=True,  # a forward alone may need none (`without_key`)
    )

  def __call__(self, x, group_sizes):
    with routing_pause.paused():  # under a swap-in, this layer's GEMMs are its own
      return self._call(x, group_sizes)

  def _call(self, x, group_sizes):
    recipe, quantizers = self._resolve()
    bias = None if self.bias is None else self.bias[...]
    return _grouped_gemm(
      x,
      self.kernel[...],
      group_sizes,
      bias,
      recipe=recipe,
      quantizers=quantizers,
      name=self.name,
      path=self.name,
      call=type(self).__name__,
      key=lambda: self._key(quantizers),
      state=_NnxStates(self, quantizers),
      what=f"GroupedDense {self.name!r}",
    )


@dataclasses.dataclass(frozen=True)
class _NnxStates:
  """An NnxGroupedDense's per-expert states, in its `quant_state` (made by `bind_role`)."""

  module: NnxGroupedDense
  quantizers: dict

  def read(self) -> Optional[dict]:
    return held_states(self.module, self.quantizers, f"GroupedDense {self.module.name!r}")

  def write(self, new_state: dict) -> None:
    write_held_states(self.module, new_state)

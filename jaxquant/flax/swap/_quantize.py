"""`quantize_model`: quantize the GEMMs of an ordinary Flax model without touching its code.

`quantize_model(model, recipe)`:

- Linen: returns `QuantizedModel(model, recipe)`, a wrapper that shares the model's
  scope (`nn.share_scope`, so the param tree is the model's own) and runs it under
  `nn.intercept_methods` (`_linen`). The interceptor redirects `__call__` of every
  `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` (exactly those classes: a subclass may
  compute something else) to `linen.gemm_call`, which uses the intercepted module's
  attributes and params. jaxquant's own Linen layers (GroupedDense included) get the
  model recipe as their fallback.
- NNX: replaces, in place, every `nnx.Linear` / `nnx.Einsum` (exactly those classes)
  reachable from the model by a jaxquant layer holding the *same* Param variables, and
  returns the model (`_nnx`). jaxquant's own NNX layers (NnxGroupedDense included) get the model
  recipe as their fallback and their module path as role name.

Every other contraction the model's code makes (`lax.dot_general`, `jnp.einsum`,
`jnp.dot`, `jnp.matmul`, `@`) is routed (`_interception`) to `_routed.handle`: where one
operand is a param of the model, it is a weight GEMM named by the param's module path
(plus the param's name unless it is `kernel`). Contractions of two
activations stay in high precision. `swap_report` lists everything met, and every
contraction of a param that nothing met (a GEMM inside a function the model's code
jitted, where the weight is that function's own argument). `_targets` names every entry
point the swap-in takes over.

Each swapped layer's roles are named by its module path, the path of its params; the
root module's weights by their own name. Layers the recipe maps to None run Flax's own
code. In a quantized model inside another, the innermost one's recipe and options hold.
With `annotate=True` the weights of stock layers also carry role metadata
(`jaxquant.flax.weight_roles`); off by default, since it changes the pytree structure of
the params (a box in Linen, Variable metadata in NNX) that checkpoints and optimizer
states of the plain model were made with.

No silent no-op: if a recipe that quantizes meets no weight GEMM in a call of the model,
that call raises (`_found_gemms`); in Linen at each trace (init or apply: the wrapper is
returned before any; the parts of the model under Flax's `nn.jit` are traced at every
call of the wrapper, see `_linen._session_scopes`), in NNX at each call.
`require_gemm=False` silences it; `swap_report` lists such a model instead. The first
call under each recipe logs one INFO line on the `jaxquant` logger: the weight GEMMs
quantized, those left in high precision and why.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn

from jaxquant import ops, recipes
from jaxquant.flax._rng import QUANT_RNG
from jaxquant.flax._weight_gather import ModelWeightGather
from jaxquant.flax.swap._linen import QuantizedModel
from jaxquant.flax.swap._nnx import quantize_nnx_model
from jaxquant.intercept._session import OnUnfit, check_on_unfit


def quantize_model(
  model: Any,
  recipe: Optional[recipes.CustomRecipe] = None,
  *,
  annotate: bool = False,
  rngs: Any = None,
  on_unfit: OnUnfit = "error",
  require_gemm: bool = True,
  weight_gather: Optional[ModelWeightGather] = None,
  shard_scaling: Optional[ops.ShardScaling] = None,
) -> Any:
  """The model with its GEMMs quantized per `recipe` (None: autocast's, else bf16).

  Args:
    model: a Linen `nn.Module` (unbound) or an NNX `nnx.Module`.
    recipe: maps each role (named by module path) to a quantizer or None: a
      `CustomRecipe` or a preset's name ("fp8_current"). Inside a model quantized in
      turn (a quantized model as a submodule of another), the innermost one's recipe,
      `on_unfit` and `weight_gather` hold.
    annotate: also put role metadata on the weights of stock layers (see the module
      docstring).
    rngs: NNX only: an `nnx.Rngs` with a "quant" stream, needed when the recipe rounds
      stochastically (Linen layers take the key from `apply(rngs={"quant": key})`).
    on_unfit: "error" (default): a GEMM whose shape a quantizer's blocks do not tile
      raises, naming the role, the dim and this option: at its first call (init
      included) for the forward's dims and for K and N (the weight's) of the backward's,
      and for M (the call's rows) of the backward's when a gradient is traced, so that
      few-token inference runs; "high_precision": it runs in high precision instead, and
      the swap report lists it with the reason. Before either, a tiny GEMM (K or N below
      one block) runs in high precision, listed with the reason, where the recipe keeps
      those there (`CustomRecipe.tiny_gemms_in_high_precision`: every preset does).
    require_gemm: raise when a recipe that quantizes finds no weight GEMM in the model
      (everything would silently stay in high precision); False allows it.
    weight_gather: Linen only: the params' shardings (`ModelWeightGather`); every
      quantized Dense / DenseGeneral / Einsum kernel is then quantized shard by shard and
      all-gathered in its quantized form over the FSDP axis (docs/sharding.md).
    shard_scaling: Linen only: `ops.ShardScaling(mesh, axis)`, the mesh axes splitting the
      tokens; every quantized dense layer (Dense, DenseGeneral, Einsum, a weight the model
      contracts) scales its input and output gradient per shard, each by its own rows'
      amax (per-tensor FP8 with current scaling only: other formats are refused), so no
      device waits on an amax all-reduce before a cast; the bits then differ from the
      unsharded model's (docs/sharding.md).
  """
  check_on_unfit(on_unfit)
  # A preset's name becomes its recipe, and what is no recipe is refused, here and now.
  recipe = None if recipe is None else recipes.resolve(recipe)
  if weight_gather is not None and not isinstance(weight_gather, ModelWeightGather):
    raise TypeError(
      "quantize_model: weight_gather must be a jaxquant.flax.ModelWeightGather, "
      f"got {type(weight_gather).__name__}"
    )
  if shard_scaling is not None and not isinstance(shard_scaling, ops.ShardScaling):
    raise TypeError(
      "quantize_model: shard_scaling must be a jaxquant.ops.ShardScaling, "
      f"got {type(shard_scaling).__name__}"
    )
  if isinstance(model, nn.Module):
    if rngs is not None:
      raise ValueError(
        "quantize_model: rngs= is for NNX models; a Linen model takes its "
        f"{QUANT_RNG!r} key in apply(..., rngs={{{QUANT_RNG!r}: key}})"
      )
    return QuantizedModel(
      model, recipe, annotate, on_unfit, require_gemm, weight_gather, shard_scaling
    )
  if shard_scaling is not None:
    raise ValueError(
      "quantize_model: shard_scaling= is for Linen models; an NNX model's layers "
      "scale their tensors per tensor"
    )
  if weight_gather is not None:
    raise ValueError(
      "quantize_model: weight_gather= is for Linen models; an NNX model's "
      "layers do not read their params' shardings, and would gather every "
      "weight in high precision"
    )
  return quantize_nnx_model(
    model, recipe, annotate=annotate, rngs=rngs, on_unfit=on_unfit, require_gemm=require_gemm
  )

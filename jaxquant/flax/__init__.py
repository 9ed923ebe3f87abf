"""Flax integration: quantized Linen and NNX layers, swap-in, delayed-scaling state.

- `jaxquant.flax.linen`: Dense, DenseGeneral, Einsum (Flax's, plus a `recipe`).
- `jaxquant.flax.nnx`: Linear, Einsum.
- `GroupedDense` (Linen), `NnxGroupedDense` (NNX): one [G, K, N] weight for all experts;
  `MoE`: a Mixture-of-Experts MLP block on GroupedDense (Linen).
- `quantize_model(model, recipe)`: quantize an ordinary Linen or NNX model's GEMMs
  (`jaxquant.flax.swap`); `weight_gather=ModelWeightGather(mesh, param_specs)` (Linen)
  all-gathers FSDP weights in their quantized form.
- `update_quant_state` / `combine_quant_state`: advance delayed-scaling state once per
  train step (`RoleState` per role, in the `QUANT_STATE` collection or a `QuantState`);
  `recorded_amaxes_finite`: whether a step's amaxes are finite, for its finiteness check.
- `weight_roles(tree_or_module)`: every annotated GEMM weight with its role and quantizer.
- `swap_report(model, ...)`: every contraction a quantized model makes, and how it runs.
- `dot_general_cls(recipe)` (Linen), `dot_general` / `einsum_op` (NNX),
  `MaxTextQuantization(recipe)`: jaxquant through Flax's and MaxText's hooks.
- `QUANT_RNG`: the RNG stream stochastic rounding draws from.

docs/flax.md names every module.
"""

from jaxquant.flax import linen, nnx
from jaxquant.flax._grouped import GroupedDense, NnxGroupedDense
from jaxquant.flax._metadata import QuantizedWeight, weight_roles
from jaxquant.flax._moe import MoE
from jaxquant.flax._rng import QUANT_RNG
from jaxquant.flax._state import (
  QUANT_STATE,
  QuantState,
  recorded_amaxes_finite,
  update_quant_state,
)
from jaxquant.flax._weight_gather import ModelWeightGather
from jaxquant.flax.swap import (
  MaxTextQuantization,
  QuantizedModel,
  SwapReport,
  dot_general,
  dot_general_cls,
  einsum_op,
  intercepting,
  quantize_model,
  swap_report,
)
from jaxquant.intercept._role_state import RoleState, combine_quant_state, is_role_state

__all__ = [
  "QUANT_RNG",
  "QUANT_STATE",
  "GroupedDense",
  "MaxTextQuantization",
  "ModelWeightGather",
  "MoE",
  "NnxGroupedDense",
  "QuantState",
  "QuantizedModel",
  "QuantizedWeight",
  "RoleState",
  "SwapReport",
  "combine_quant_state",
  "dot_general",
  "dot_general_cls",
  "einsum_op",
  "intercepting",
  "is_role_state",
  "linen",
  "nnx",
  "quantize_model",
  "recorded_amaxes_finite",
  "swap",
  "swap_report",
  "update_quant_state",
  "weight_roles",
]

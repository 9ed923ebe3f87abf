"""Flax integration: quantized Linen and NNX layers, swap-in, delayed-scaling state.

- `jaxquant.flax.linen`: Dense, DenseGeneral, Einsum (Flax's, plus a `recipe`).
- `jaxquant.flax.nnx`: Linear, Einsum.
- `quantize_model(model, recipe)`: quantize an ordinary Linen or NNX model's GEMMs;
  `weight_gather=ModelWeightGather(mesh, param_specs)` (Linen) all-gathers FSDP weights
  in their quantized form.
- `update_quant_state` / `combine_quant_state`: advance delayed-scaling state once per
  train step (`jaxquant.flax.state` explains the flow).
- `weight_roles(tree_or_module)`: every annotated GEMM weight with its role and quantizer.
- `swap_report(model, ...)`: every contraction a quantized model makes, and how it runs.
- `dot_general_cls(recipe)` (Linen), `dot_general` / `einsum_op` (NNX),
  `MaxTextQuantization(recipe)`: jaxquant through Flax's and MaxText's hooks.
"""

from jaxquant.flax import linen
from jaxquant.flax.dot_general import MaxTextQuantization, dot_general, dot_general_cls, einsum_op
from jaxquant.flax.metadata import QuantizedWeight, weight_roles
from jaxquant.flax.nnx import QuantState
from jaxquant.flax.report import SwapReport, swap_report
from jaxquant.flax.state import QUANT_STATE, RoleState, combine_quant_state, update_quant_state
from jaxquant.flax.swap import QuantizedModel, intercepting, quantize_model
from jaxquant.flax.weight_gather import ModelWeightGather

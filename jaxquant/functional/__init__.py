"""Quantize the GEMMs of any JAX function: plain JAX over a params pytree, Equinox.

- `quantize(fn, recipe, *, params_argnum=0, on_unfit="error")`: a `QuantizedFunction`,
  `fn` with every GEMM of a param (an array leaf of argument `params_argnum`) quantized
  per the recipe, its roles named by the param's path ("layers/mlp/w_in"). Call it like
  `fn`; `init(*args)` makes the delayed-scaling state, `apply(*args, state=, rng=)`
  returns `(output, new_state)` and draws stochastic rounding's keys from `rng`.
- `update_quant_state`, `combine_quant_state`, `recorded_amaxes_finite`: a train step's
  handling of that state (`RoleState`s), as for Flax models.
- `swap_report(qfn, *args)`: every contraction one call makes, and how it runs.

No Flax is imported: docs/functions.md has a complete example.
"""

from jaxquant.functional._quantize import QuantizedFunction, quantize
from jaxquant.functional._report import swap_report
from jaxquant.intercept._report import SwapReport
from jaxquant.intercept._role_state import (
  RoleState,
  combine_quant_state,
  recorded_amaxes_finite,
  update_quant_state,
)

__all__ = [
  "QuantizedFunction",
  "RoleState",
  "SwapReport",
  "combine_quant_state",
  "quantize",
  "recorded_amaxes_finite",
  "swap_report",
  "update_quant_state",
]

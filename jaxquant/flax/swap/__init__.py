"""The swap-in: quantize the GEMMs of an ordinary Flax model without touching its code.

- `quantize_model(model, recipe)`: a Linen model wrapped (`QuantizedModel`), an NNX
  model changed in place; its stock layers and every contraction its own code makes with
  a param operand follow the recipe.
- `intercepting(recipe)`: the Linen layers of any method, under a context.
- `swap_report(model, ...)`: every contraction a quantized model makes, and how it runs.
- `dot_general_cls(recipe)` (Linen), `dot_general` / `einsum_op` (NNX),
  `MaxTextQuantization(recipe)`: jaxquant through Flax's and MaxText's hooks.

It stands on the quantized layers and state of `jaxquant.flax`, which never import it.
"""

from jaxquant.flax.swap._hooks import MaxTextQuantization, dot_general, dot_general_cls, einsum_op
from jaxquant.flax.swap._linen import QuantizedModel, intercepting
from jaxquant.flax.swap._quantize import quantize_model
from jaxquant.flax.swap._report import SwapReport, swap_report

__all__ = [
  "MaxTextQuantization",
  "QuantizedModel",
  "SwapReport",
  "dot_general",
  "dot_general_cls",
  "einsum_op",
  "intercepting",
  "quantize_model",
  "swap_report",
]

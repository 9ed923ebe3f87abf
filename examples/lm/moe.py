"""`--moe`: every block's MLP becomes jaxquant's Mixture-of-Experts block (jaxquant.flax.MoE).

The block routes each token to TOP_K of NUM_EXPERTS experts, each a gated SiLU MLP whose
three projections are `GroupedDense` layers (one [experts, in, out] weight each, role
module_type "grouped_linear"). Its router stays a high-precision nn.Dense (see
lm/recipes.py). Its Switch load-balancing loss, times AUX_LOSS_WEIGHT, is sown into the
AUX_LOSSES collection, which the train step adds to the loss.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax

from jaxquant import recipes
from jaxquant.flax import MoE
from lm.model import AUX_LOSSES, ModelConfig, MoeMlpFactory

NUM_EXPERTS = 4
TOP_K = 2
# Small: it only has to keep the router from collapsing onto a few experts.
AUX_LOSS_WEIGHT = 1e-2


class MoeMlp(nn.Module):
  """[batch, seq, d_model] -> [batch, seq, d_model] through jaxquant's MoE block.

  Each expert's hidden size is d_ff / TOP_K, so a token's expert FLOPs stay near the
  dense MLP's.
  """

  config: ModelConfig
  recipe: Optional[recipes.CustomRecipe] = None  # for the grouped projections; None: bf16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y, load_balancing_loss = MoE(
      NUM_EXPERTS, self.config.d_ff // TOP_K, top_k=TOP_K, recipe=self.recipe, name="moe"
    )(x)
    self.sow(AUX_LOSSES, "load_balancing", AUX_LOSS_WEIGHT * load_balancing_loss)
    return y


def moe_mlp_factory(recipe) -> MoeMlpFactory:
  """The model's MLP hook, with the recipe the grouped projections follow (None: bf16).

  The recipe is passed explicitly: `quantize_model` swaps nn.Dense layers and gives
  jaxquant's own Dense/Einsum layers its recipe, but not GroupedDense.
  """
  return functools.partial(MoeMlp, recipe=recipe)

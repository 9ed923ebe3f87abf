"""MaxText (PyPI `maxtext`): llama2 from its llama2-7b config, shrunk, as its NNX Transformer."""

from __future__ import annotations

import os
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import maxtext.configs
from checks import BATCH, HEAD_DIM, HEADS, MLP, SEQ, VOCAB, WIDTH, NnxModel
from flax import nnx
from maxtext.configs import pyconfig
from maxtext.models.models import Transformer
from maxtext.utils import maxtext_utils

import jaxquant.flax as jqf
from jaxquant import recipes as jq_recipes


def models() -> list[NnxModel]:
  """llama2 (MaxText's llama2-7b config, shrunk), its NNX Transformer."""
  base_yml = os.path.join(os.path.dirname(maxtext.configs.__file__), "base.yml")
  overrides = dict(
    model_name="llama2-7b",
    override_model_config=True,
    run_name="jaxquant_real_models",
    base_emb_dim=WIDTH,
    base_num_query_heads=HEADS,
    base_num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    base_mlp_dim=MLP,
    base_num_decoder_layers=2,
    vocab_size=VOCAB,
    max_target_length=SEQ,
    per_device_batch_size=BATCH,
    attention="dot_product",  # the CPU's attention
    hardware="cpu",
    enable_checkpointing=False,
    skip_jax_distributed_system=True,
    enable_dropout=False,
  )
  config = pyconfig.initialize([sys.argv[0], base_yml, *(f"{k}={v}" for k, v in overrides.items())])
  mesh = maxtext_utils.get_mesh_from_config(config)

  def build(recipe: Optional[str]):
    quant = None if recipe is None else jqf.MaxTextQuantization(jq_recipes.get(recipe))
    # An "aqt" stream: MaxText keeps it for a hook that rounds stochastically (nvfp4).
    return Transformer(config, mesh, quant=quant, rngs=nnx.Rngs(0, aqt=1))

  positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
  common = dict(
    build=build,
    call_args=lambda tokens: ((tokens, positions), {"enable_dropout": False}),
    logits_of=lambda out: out,
    context=lambda model: jax.set_mesh(mesh),
  )
  return [
    NnxModel("llama2 (quantize_model)", **common),
    NnxModel("llama2 (MaxText quant=)", through_hook=True, **common),
  ]

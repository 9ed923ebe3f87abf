"""EasyDeL (PyPI `easydel`): a tiny Llama with gradient checkpointing."""

from __future__ import annotations

import importlib
import os
import types
from typing import Optional

import jax.numpy as jnp
from checks import HEAD_DIM, HEADS, MLP, SEQ, VOCAB, WIDTH, NnxModel
from flax import nnx


def models() -> list[NnxModel]:
  """Llama (EasyDeL's LlamaConfig, tiny) with gradient checkpointing."""
  # EasyDeL 0.3.0 patches some Hugging Face torch classes while it imports; without torch
  # installed, transformers answers those look-ups with an ImportError. An empty module
  # stands in for each (the Llama model used here touches none of them).
  for name in ("glm4v_moe", "phimoe", "llama4", "qwen3_5_moe", "qwen3_next", "dbrx"):
    package = importlib.import_module(f"transformers.models.{name}")
    setattr(package, f"modeling_{name}", types.ModuleType(f"modeling_{name}"))
  # EasyDeL's import otherwise appends its GPU and TPU tuning flags to XLA_FLAGS, which
  # the CPU backend of JAX 0.10 rejects as unknown (a fatal error).
  os.environ.setdefault("EASYDEL_AUTO", "0")
  import easydel as ed  # after the stand-ins and the flag above

  config = ed.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=MLP,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=SEQ,
    gradient_checkpointing=ed.EasyDeLGradientCheckPointers.NOTHING_SAVEABLE,
  )

  def build(recipe: Optional[str]):
    del recipe  # EasyDeL has no quantization hook of its own for jaxquant: quantize_model
    return ed.LlamaForCausalLM(
      config=config, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
    )

  return [
    NnxModel(
      "llama (gradient checkpointing)",
      build=build,
      call_args=lambda tokens: ((), {"input_ids": tokens}),
      logits_of=lambda out: out.logits,
      context=lambda model: model.mesh,  # its sharding constraints need its mesh
    )
  ]

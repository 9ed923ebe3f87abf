"""transformers (PyPI `transformers`, its Flax models): Llama and GPT-2, tiny configs.

The Linen module of each Flax model class (`FlaxLlamaForCausalLM(...).module`), built
without its random init (`_do_init=False`): the checks initialise its params. GPT-2 runs
with its head tied to the token embedding (transformers' default: the head is a nested
`lm_head.apply({"params": {"kernel": wte.T}})`) and untied (its own `lm_head/kernel`).
"""

from __future__ import annotations

import jax.numpy as jnp
from checks import HEAD_DIM, HEADS, MLP, SEQ, VOCAB, WIDTH, LinenModel
from transformers import FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, LlamaConfig


def call_args(tokens):
  """The modules' own call: an attention mask and positions beside the tokens (no dropout)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
  return (tokens, jnp.ones_like(tokens), positions), {"deterministic": True}


def models() -> list[LinenModel]:
  """Llama (untied head) and GPT-2 (tied and untied head), 2 layers, width 64."""
  llama = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=WIDTH,
    intermediate_size=MLP,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    # Its sin/cos table keeps only the first `max_position_embeddings` of its 2 x head_dim
    # columns (`create_sinusoidal_positions`): fewer than 2 x head_dim breaks the rotary
    # embedding, which released configs (2048 and more) never meet.
    max_position_embeddings=max(SEQ, 2 * HEAD_DIM),
  )

  def gpt2(tied: bool) -> GPT2Config:
    return GPT2Config(
      vocab_size=VOCAB,
      n_positions=SEQ,
      n_embd=WIDTH,
      n_layer=2,
      n_head=HEADS,
      n_inner=MLP,
      tie_word_embeddings=tied,
    )

  def module(model_class, config):
    return model_class(config, dtype=jnp.bfloat16, _do_init=False).module

  logits_of = lambda out: out.logits
  return [
    LinenModel(
      "llama (FlaxLlamaForCausalLM)", module(FlaxLlamaForCausalLM, llama), logits_of, call_args
    ),
    LinenModel(
      "gpt2, tied head (FlaxGPT2LMHeadModel)",
      module(FlaxGPT2LMHeadModel, gpt2(tied=True)),
      logits_of,
      call_args,
    ),
    LinenModel(
      "gpt2, untied head (FlaxGPT2LMHeadModel)",
      module(FlaxGPT2LMHeadModel, gpt2(tied=False)),
      logits_of,
      call_args,
    ),
  ]

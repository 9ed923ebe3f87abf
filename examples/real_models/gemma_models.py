"""gemma (PyPI `gemma`): Gemma 3 and Gemma 4 models from the released configs, shrunk."""

from __future__ import annotations

import dataclasses

from checks import HEAD_DIM, HEADS, MLP, VOCAB, WIDTH, LinenModel
from gemma import gm


def models() -> list[LinenModel]:
  """Gemma 3 (dense) and Gemma 4 (dense, with per-layer inputs, MoE): released configs, shrunk."""
  # Two layers, a sliding-window one and a global one, from each release's own enum
  # (Gemma 4's layer types are an enum of their own).
  gemma3_types = gm.nn.config.make_attention_layers_types(
    (gm.nn.config.AttentionType.LOCAL_SLIDING, gm.nn.config.AttentionType.GLOBAL), num_layers=2
  )
  released = gm.nn.Gemma4_31B.config.attention_types
  gemma4_types = (released[0], next(t for t in released if t != released[0]))
  tiny = dict(num_embed=VOCAB, embed_dim=WIDTH, hidden_dim=MLP, num_heads=HEADS)
  tiny.update(head_dim=HEAD_DIM, num_kv_heads=1, sliding_window_size=8, vision_encoder=None)
  gemma3 = dataclasses.replace(gm.nn.Gemma3_270M.config, attention_types=gemma3_types, **tiny)
  gemma4_tiny = dict(
    tiny,
    attention_types=gemma4_types,
    num_global_kv_heads=1,
    global_key_size=WIDTH,
    audio_encoder=None,
    use_bidirectional_attention=None,
  )
  gemma4_dense = dataclasses.replace(gm.nn.Gemma4_31B.config, **gemma4_tiny)
  gemma4_moe = dataclasses.replace(
    gm.nn.Gemma4_26B_A4B.config,
    **gemma4_tiny,
    num_experts=4,
    expert_dim=HEAD_DIM,
    top_k_experts=2,
    moe_dense_hidden_dim=MLP,
  )
  # Gemma 4's small models add per-layer inputs (a projection whose weight is scaled
  # before its contraction) and layers that share their KV: four layers, half sharing.
  edge = gm.nn.Gemma4_E2B.config
  gemma4_edge = dataclasses.replace(
    edge,
    **dict(gemma4_tiny, attention_types=gemma4_types * 2),
    per_layer_input_dim=HEAD_DIM,
    override_kv_shared_ffw_hidden=2 * MLP,
    kv_cache_sharing_config=dataclasses.replace(
      edge.kv_cache_sharing_config, frac_shared_layers=0.5
    ),
  )
  logits_of = lambda out: out.logits
  return [
    LinenModel("gemma3 dense (Gemma3_270M config)", gm.nn.Gemma3_270M(config=gemma3), logits_of),
    LinenModel(
      "gemma4 dense (Gemma4_31B config)", gm.nn.Gemma4_31B(config=gemma4_dense), logits_of
    ),
    LinenModel(
      "gemma4 per-layer inputs (Gemma4_E2B config)", gm.nn.Gemma4_E2B(config=gemma4_edge), logits_of
    ),
    LinenModel(
      "gemma4 MoE (Gemma4_26B_A4B config)", gm.nn.Gemma4_26B_A4B(config=gemma4_moe), logits_of
    ),
  ]

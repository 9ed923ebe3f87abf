"""Parameters of the model under one scan layout, moved to another.

`ModelConfig.scanned_layers` runs the first decoder layers under nn.scan, whose params
stack along a leading axis in 'decoder/layers/layer'; the rest are 'decoder/layer_<i>'.
The numbers are the same either way; `relayout` moves them, so that a model with another
scan layout (an unrolled one for the sensitivity analysis, whose roles must name each
layer) starts from the very parameters the other recipes start from.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lm.model import SCANNED_LAYERS, ModelConfig

DECODER = "decoder"
SCAN_BODY = "layer"  # the DecoderLayer inside nn.scan's step


def per_layer(params: Any, config: ModelConfig) -> list[Any]:
  """Each decoder layer's params, in order."""
  decoder = params[DECODER]
  layers = []
  if config.scanned_layers:
    stacked = decoder[SCANNED_LAYERS][SCAN_BODY]
    layers += [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(config.scanned_layers)]
  return layers + [decoder[f"layer_{i}"] for i in range(config.scanned_layers, config.n_layers)]


def relayout(params: Any, config: ModelConfig, scanned_layers: int) -> Any:
  """params of a model with `config` -> those of the same model with `scanned_layers`."""
  if not 0 <= scanned_layers <= config.n_layers:
    raise ValueError(f"scanned_layers={scanned_layers} must be in [0, {config.n_layers}]")
  layers = per_layer(params, config)
  decoder = {
    k: v for k, v in params[DECODER].items() if k != SCANNED_LAYERS and not k.startswith("layer_")
  }
  if scanned_layers:
    decoder[SCANNED_LAYERS] = {
      SCAN_BODY: jax.tree.map(lambda *a: jnp.stack(a), *layers[:scanned_layers])
    }
  decoder.update({f"layer_{i}": layers[i] for i in range(scanned_layers, config.n_layers)})
  return {**params, DECODER: decoder}

"""An NNX model holding a Linen module through Flax's bridge (`nnx.bridge.ToNNX`) under
`quantize_model`: the bridge turns every attribute it holds into a Linen variable, so the
swap-in gives it none of its own (no path, no session token)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

X = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)


class WithBridge(nnx.Module):
  def __init__(self, rngs):
    self.bridged = nnx.bridge.ToNNX(nn.Dense(64), rngs=rngs)
    self.fc = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    return self.fc(self.bridged(x))


def _model():
  model = WithBridge(nnx.Rngs(0))
  nnx.bridge.lazy_init(model.bridged, X)
  return model


def test_bf16_is_the_plain_model_and_fp8_runs():
  plain = _model()(X)
  np.testing.assert_array_equal(jqf.quantize_model(_model(), recipes.bf16)(X), plain)
  quantized = jqf.quantize_model(_model(), recipes.fp8_current)
  assert np.all(np.isfinite(np.asarray(quantized(X))))
  assert "fc" in {r.role for r in jqf.swap_report(quantized, X).quantized}

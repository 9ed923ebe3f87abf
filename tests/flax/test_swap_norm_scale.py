"""A norm that scales by its param through an einsum that contracts no axis (MaxText's
RMSNorm: `einsum('...k,k->...k', y, scale)`) is no GEMM: it runs as written and the
report says why, however the recipe maps the norm's role. Linen and NNX."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

X = jax.random.normal(jax.random.key(0), (2, 32, 64), jnp.float32)
NO_AXIS = (
  "high precision: not a weight GEMM (it contracts no axis: an elementwise or outer product)"
)
# The dense layer in high precision, every other role in FP8: the output is the plain
# model's exactly when the norm's scale is left as it is.
DENSE_IN_BF16 = recipes.CustomRecipe(
  lambda role: None if role.name == "out" else recipes.fp8_current_factory(role)
)


def _rms(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


class LinenNormed(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.normal(1.0), (64,))
    return nn.Dense(64, name="out")(jnp.einsum("...k,k->...k", _rms(x), scale))


class NnxNormed(nnx.Module):
  def __init__(self, rngs):
    self.scale = nnx.Param(jax.random.normal(rngs.params(), (64,)))
    self.out = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.einsum("...k,k->...k", _rms(x), self.scale[...]))


def _statuses(report):
  return sorted(r.status for r in report.rows)


def test_linen_norm_scale_runs_as_written():
  variables = LinenNormed().init(jax.random.key(1), X)
  model = jqf.quantize_model(LinenNormed(), DENSE_IN_BF16, require_gemm=False)
  np.testing.assert_array_equal(model.apply(variables, X), LinenNormed().apply(variables, X))
  report = jqf.swap_report(jqf.quantize_model(LinenNormed(), recipes.fp8_current), variables, X)
  assert _statuses(report) == [NO_AXIS, "quantized"]


def test_nnx_norm_scale_runs_as_written():
  plain = NnxNormed(nnx.Rngs(1))(X)
  model = jqf.quantize_model(NnxNormed(nnx.Rngs(1)), DENSE_IN_BF16, require_gemm=False)
  np.testing.assert_array_equal(model(X), plain)
  report = jqf.swap_report(jqf.quantize_model(NnxNormed(nnx.Rngs(1)), recipes.fp8_current), X)
  assert _statuses(report) == [NO_AXIS, "quantized"]

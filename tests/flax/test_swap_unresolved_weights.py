"""A weight-like operand that the swap-in cannot trace to its param (two params of its
shape, a value mixed in that is not a param, an eager value) runs in high precision,
listed by `swap_report` with why, and counted in one warning per model call."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes
from jaxquant.intercept import _session as sessions

B, D, F = 32, 64, 32
RECIPE = recipes.fp8_current


class TwoOfItsShape(nn.Module):
  """`w + delta`: two params of the operand's shape; and a plain GEMM, quantized."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, F))
    delta = self.param("delta", nn.initializers.normal(0.01), (D, F))
    v = self.param("v", nn.initializers.normal(0.05), (F, F))
    return jnp.einsum("bd,df->bf", x, w + delta) @ v


def inputs():
  return jax.random.normal(jax.random.key(1), (B, D), jnp.float32)


def test_linen_ambiguous_weight_is_listed_and_warned_once_per_call():
  x = inputs()
  model = jqf.quantize_model(TwoOfItsShape(), RECIPE)
  params = jax.jit(model.init)(jax.random.key(0), x)
  rows = jqf.swap_report(model, params, x).rows
  assert rows[0].role is None and rows[0].status.startswith(sessions.UNRESOLVED)
  assert "'w' and 'delta'" in rows[0].status
  assert (rows[1].role, rows[1].status) == ("v", sessions.QUANTIZED)
  with pytest.warns(UserWarning) as caught:
    y = jax.jit(model.apply)(params, x)
  (warning,) = [w for w in caught if "weight-like" in str(w.message)]
  assert "1 weight-like GEMM" in str(warning.message) and "'w' and 'delta'" in str(warning.message)
  plain = TwoOfItsShape().apply(params, x)
  assert not np.array_equal(y, plain)  # v's GEMM is quantized; the other runs as written


class NnxScaled(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(nn.initializers.normal(0.05)(rngs.params(), (D, F)))
    self.w_scale = nnx.Param(jnp.full((F,), 0.5))

  def __call__(self, x):
    return jnp.einsum("bd,df->bf", x, self.w[...] * self.w_scale[...])


def test_nnx_eager_scaled_weight_is_warned_traced_is_quantized():
  x = inputs()
  model = jqf.quantize_model(NnxScaled(nnx.Rngs(0)), RECIPE, require_gemm=False)
  with pytest.warns(UserWarning, match=r"1 weight-like GEMM.*eager.*jit"):
    model(x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    nnx.jit(lambda m, x: m(x))(model, x)
  assert [r.status for r in jqf.swap_report(model, x).rows] == [sessions.QUANTIZED]


class Activations(nn.Module):
  """`x * g` with a param of x's shape, then contracted with x: an activation, warned
  about (the walk cannot tell x from another module's param)."""

  @nn.compact
  def __call__(self, x):
    g = self.param("g", nn.initializers.normal(1.0), (B, D))
    return jnp.einsum("bd,cd->bc", x * g, x)


def test_an_activation_mixed_with_a_weight_shaped_param_is_listed_not_quantized():
  x = inputs()
  model = jqf.quantize_model(Activations(), RECIPE, require_gemm=False)
  params = jax.jit(model.init)(jax.random.key(0), x)
  (row,) = jqf.swap_report(model, params, x).rows
  assert row.role is None and row.status.startswith(sessions.UNRESOLVED)
  assert "not its module's params" in row.status
  with pytest.warns(UserWarning, match="1 weight-like GEMM"):
    np.testing.assert_array_equal(
      jax.jit(model.apply)(params, x), jax.jit(Activations().apply)(params, x)
    )


class LinenScaled(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (D, F))
    return jnp.einsum("bd,df->bf", x, w * self.param("w_scale", nn.initializers.uniform(1.0), (F,)))


def test_eagerly_a_model_whose_only_weights_are_scaled_says_why_it_found_no_gemm():
  x = inputs()
  model = jqf.quantize_model(LinenScaled(), RECIPE)
  with pytest.raises(ValueError, match=r"no GEMM.*1 of them.*looks like a weight.*eager.*jit"):
    model.init(jax.random.key(0), x)
  params = jax.jit(model.init)(jax.random.key(0), x)  # traced: the scaled weight's GEMM
  assert [r.role for r in jqf.swap_report(model, params, x).quantized] == ["w"]

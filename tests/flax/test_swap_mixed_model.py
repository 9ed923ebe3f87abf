"""A model whose three weight GEMMs are written three ways: `jnp.einsum` on a param, a
product inside a `jax.jit`-wrapped helper the module calls, and an einsum bound at import
(`from jax.numpy import einsum`). The swap-in quantizes the first and the last; the one
inside the jitted helper (its operand there is the helper's own tracer, and its trace may
be cached from a call before quantization) is a row of `swap_report` with its reason,
never silently absent."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.numpy import einsum as bound_einsum

import jaxquant.flax as jqf
from jaxquant import recipes

D = 64
X = jax.random.normal(jax.random.key(1), (32, D), jnp.float32)


@jax.jit
def jitted_product(x, w):
  return x @ w


def forward(x, w_in, w_mid, w_out):
  h = jnp.einsum("bd,df->bf", x, w_in)
  h = jitted_product(jax.nn.relu(h), w_mid)
  return bound_einsum("bf,fd->bd", jax.nn.relu(h), w_out)


class LinenMixed(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.normal(0.05)
    return forward(
      x,
      self.param("w_in", init, (D, D)),
      self.param("w_mid", init, (D, D)),
      self.param("w_out", init, (D, D)),
    )


class NnxMixed(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.normal(0.05)
    self.w_in = nnx.Param(init(rngs.params(), (D, D)))
    self.w_mid = nnx.Param(init(rngs.params(), (D, D)))
    self.w_out = nnx.Param(init(rngs.params(), (D, D)))

  def __call__(self, x):
    return forward(x, self.w_in[...], self.w_mid[...], self.w_out[...])


def _weight_rows(report) -> dict:
  return {r.role: r for r in report.rows if r.is_weight_gemm}


def _check(report):
  rows = _weight_rows(report)
  assert sorted(rows) == ["w_in", "w_mid", "w_out"], str(report)
  assert rows["w_in"].status == rows["w_out"].status == "quantized", str(report)
  assert rows["w_mid"].status.startswith("high precision: inside a jitted function"), str(report)
  assert "'jitted_product'" in rows["w_mid"].status, str(report)
  # The row says where to look: a trace of its own, not reached by the interception.
  assert "not traceable to a param" in rows["w_mid"].status


@pytest.mark.parametrize("cached", [False, True], ids=["fresh_trace", "cached_trace"])
def test_linen_mixed_model_reports_every_weight_gemm(cached):
  jitted_product.clear_cache()
  variables = LinenMixed().init(jax.random.key(0), X)
  if cached:  # the helper's trace is cached by a call of the plain model
    jax.block_until_ready(LinenMixed().apply(variables, X))
  model = jqf.quantize_model(LinenMixed(), recipes.mxfp8)
  got = model.apply(variables, X)
  assert not np.array_equal(got, LinenMixed().apply(variables, X))  # w_in, w_out quantized
  _check(jqf.swap_report(model, variables, X))


@pytest.mark.parametrize("cached", [False, True], ids=["fresh_trace", "cached_trace"])
def test_nnx_mixed_model_reports_every_weight_gemm(cached):
  jitted_product.clear_cache()
  model = NnxMixed(nnx.Rngs(0))
  if cached:
    jax.block_until_ready(model(X))
  model = jqf.quantize_model(model, recipes.mxfp8)
  jax.block_until_ready(model(X))
  _check(jqf.swap_report(model, X))


def test_the_report_lists_a_jitted_gemm_once_the_model_computes_it_in_high_precision():
  """The unreached GEMM computes as written: the report's row is what runs."""
  jitted_product.clear_cache()
  variables = LinenMixed().init(jax.random.key(0), X)
  only_mid = recipes.CustomRecipe(
    lambda role: None if role.name != "w_mid" else recipes.mxfp8_factory(role), name="mid"
  )
  model = jqf.quantize_model(LinenMixed(), only_mid, require_gemm=False)
  np.testing.assert_array_equal(model.apply(variables, X), LinenMixed().apply(variables, X))
  rows = _weight_rows(jqf.swap_report(model, variables, X))
  assert rows["w_mid"].status.startswith("high precision: inside a jitted function")


class Tensordot(nn.Module):
  """`jnp.tensordot` contracts through `dot_general` from JAX's own module, which the
  swap-in does not take over."""

  @nn.compact
  def __call__(self, x):
    return jnp.tensordot(x, self.param("w", nn.initializers.normal(0.05), (D, D)), 1)


def test_a_contraction_of_a_param_that_the_interception_never_met_is_listed():
  variables = Tensordot().init(jax.random.key(0), X)
  model = jqf.quantize_model(Tensordot(), recipes.mxfp8, require_gemm=False)
  np.testing.assert_array_equal(model.apply(variables, X), Tensordot().apply(variables, X))
  (row,) = jqf.swap_report(model, variables, X).rows
  assert (row.role, row.shapes) == ("w", ((32, D), (D, D)))
  assert row.status.startswith("high precision: not reached by the swap-in"), row.status

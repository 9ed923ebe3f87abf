"""`swap_report` of a model without a weight GEMM, and the line a quantized model logs
at its first call."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes


class NoWeightGemm(nn.Module):
  """A param, but only elementwise; its one contraction is of two activations."""

  @nn.compact
  def __call__(self, x):
    x = x * self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return jnp.einsum("bd,bd->b", x, x)


class Small(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, name="fc")(x)
    gram = jnp.einsum("bd,cd->bc", h, h)  # no param operand
    return nn.Dense(32, name="head")(h) + gram.sum()


HEAD_IN_BF16 = recipes.CustomRecipe(
  lambda role: None if role.name == "head" else recipes.mxfp8_factory(role), name="head_bf16"
)
X = jnp.ones((32, 64), jnp.float32)


def test_swap_report_of_a_model_without_weight_gemm():
  model = jqf.quantize_model(NoWeightGemm(), "mxfp8", require_gemm=True)
  variables = NoWeightGemm().init(jax.random.key(0), X)
  report = jqf.swap_report(model, variables, X)
  assert report.quantized == () and len(report.rows) == 1, str(report)
  assert "not a weight GEMM" in report.rows[0].status
  with pytest.raises(ValueError, match="made no GEMM with a weight"):
    model.apply(variables, X)  # the model itself still refuses to run all in high precision


def _lines(caplog):
  return [r for r in caplog.records if r.name == "jaxquant"]


def test_first_apply_logs_one_line_per_model(caplog):
  caplog.set_level(logging.INFO, logger="jaxquant")
  variables = Small().init(jax.random.key(0), X)
  model = jqf.quantize_model(Small(), HEAD_IN_BF16)
  jqf.swap_report(model, variables, X)
  assert _lines(caplog) == []  # the report lists it all; it is no call of the model
  model.apply(variables, X)
  model.apply(variables, X)
  jax.jit(model.apply)(variables, X)
  (line,) = _lines(caplog)
  assert line.levelno == logging.INFO
  assert line.getMessage() == (
    "quantize_model(Small) under recipe 'head_bf16': 1 of 2 weight GEMMs quantized, "
    "1 in high precision (the recipe maps it to None: 1); "
    "1 other contractions (no param operand) in high precision"
  )
  jqf.quantize_model(Small(), HEAD_IN_BF16).apply(variables, X)  # another model: its own line
  assert len(_lines(caplog)) == 2


def test_a_wrapper_without_recipe_logs_once_per_recipe(caplog):
  caplog.set_level(logging.INFO, logger="jaxquant")
  variables = Small().init(jax.random.key(0), X)
  model = jqf.quantize_model(Small())
  with recipes.autocast(recipes.mxfp8):
    model.apply(variables, X)
    model.apply(variables, X)
  model.apply(variables, X)  # bf16
  assert [r.getMessage().split(":")[0] for r in _lines(caplog)] == [
    "quantize_model(Small) under recipe 'mxfp8'",
    "quantize_model(Small) under recipe 'bf16'",
  ]


class NnxNoWeightGemm(nnx.Module):
  def __init__(self, rngs):
    self.scale = nnx.Param(jnp.ones((64,)))

  def __call__(self, x):
    x = x * self.scale
    return jnp.einsum("bd,bd->b", x, x)


class NnxSmall(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(64, 64, rngs=rngs)
    self.head = nnx.Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    return self.head(self.fc(x))


def test_swap_report_of_an_nnx_model_without_weight_gemm():
  model = jqf.quantize_model(NnxNoWeightGemm(nnx.Rngs(0)), "mxfp8")
  report = jqf.swap_report(model, X)
  assert report.quantized == () and len(report.rows) == 1, str(report)
  with pytest.raises(ValueError, match="made no GEMM with a weight"):
    model(X)


def test_an_nnx_model_logs_one_line_at_its_first_call(caplog):
  caplog.set_level(logging.INFO, logger="jaxquant")
  model = jqf.quantize_model(NnxSmall(nnx.Rngs(0)), HEAD_IN_BF16)
  jqf.swap_report(model, X)
  assert _lines(caplog) == []
  model(X)
  model(X)
  (line,) = _lines(caplog)
  assert line.getMessage() == (
    "quantize_model(NnxSmall) under recipe 'head_bf16': 1 of 2 weight GEMMs quantized, "
    "1 in high precision (the recipe maps it to None: 1); "
    "0 other contractions (no param operand) in high precision"
  )

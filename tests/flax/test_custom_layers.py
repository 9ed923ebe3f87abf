"""Swap-in of models whose GEMMs are their own layers (routed contractions): Linen, in
the style of gemma (jnp.einsum, a tied head through jnp.dot) and of MaxText
(lax.dot_general, and its quantization hook)."""

import re

import custom_layers as cl
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_transformers as tt

import jaxquant.flax as jqf
from jaxquant import ops, recipes

STEPS = 20


def windows(seed=0):
  starts = jax.random.randint(jax.random.key(seed), (cl.BATCH, 1), 0, cl.VOCAB)
  return (starts + jnp.arange(cl.SEQ + 1)) % cl.VOCAB


def head_in_bf16(factory, head):
  return recipes.CustomRecipe(
    lambda role: None if role.name == head else factory(role),
    name=factory.__name__.replace("_factory", ""),
  )


# Per-tensor scales and random keys (NVFP4's stochastic rounding): the two ways a factory's
# quantizers reach a custom layer's GEMMs differently. (MXFP8 trains the NNX custom layers,
# test_custom_layers_nnx.py; its quantizer is checked bit for bit in tests/reference.)
TRAINED = [recipes.fp8_current_factory, recipes.nvfp4_factory]


def roles_seen(model, tokens):
  seen = []
  recording = recipes.CustomRecipe(lambda role: seen.append(role))
  jax.eval_shape(jqf.quantize_model(model, recording).init, jax.random.key(0), tokens)
  return seen


def strip_locations(text):
  return re.sub(r"loc\([^)]*\)", "", re.sub(r"#loc\d*( = .*)?", "", text))


@pytest.fixture(scope="module")
def gemma():
  data = windows()
  params, _ = tt.linen_init(cl.GemmaStyleLM(), data)
  return params, data


# ---- (a) gemma style ----


def test_gemma_roles_are_every_weight_once():
  seen = roles_seen(cl.GemmaStyleLM(), windows()[:, :-1])
  # init runs the model once as written, then once quantized: each role is asked once.
  assert len(seen) == 3 * len(cl.GEMMA_ROLES)
  assert {(r.name, r.tensor_type) for r in seen} == {
    (n, t) for n in cl.GEMMA_ROLES for t in ("input", "weight", "grad_output")
  }
  assert {r.module_type for r in seen} == {"linear"}


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_gemma_bf16_is_the_plain_model_and_compiles_to_its_hlo(gemma):
  params, data = gemma
  plain = tt.linen_train_step(cl.GemmaStyleLM(), tt.optimizer())
  swapped = tt.linen_train_step(jqf.quantize_model(cl.GemmaStyleLM(), recipes.bf16), tt.optimizer())
  args = (params, tt.optimizer().init(params), {}, data, jax.random.key(0))
  hlo = [strip_locations(jax.jit(step).lower(*args).as_text()) for step in (plain, swapped)]
  assert hlo[0] == hlo[1]
  for a, b in zip(jax.jit(plain)(*args), jax.jit(swapped)(*args), strict=False):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("factory", TRAINED, ids=lambda f: f.__name__)
@pytest.mark.slow
def test_gemma_trains(gemma, factory):
  params, data = gemma
  model = jqf.quantize_model(cl.GemmaStyleLM(), head_in_bf16(factory, cl.HEAD_ROLE))
  losses, _ = tt.train_linen(model, params, {}, STEPS, data)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.8 * losses[0], losses


@pytest.mark.slow
def test_gemma_fp8_grads_equal_stock_layers(gemma):
  data = gemma[1]
  stock_params, _ = tt.linen_init(cl.StockGemmaLM(), data)
  recipe = head_in_bf16(recipes.fp8_current_factory, cl.HEAD_ROLE)

  def grads(model, params):
    loss = lambda p: tt.xent(model.apply({"params": p}, data[:, :-1]), data)
    return jax.jit(jax.grad(loss))(params)

  stock = grads(jqf.quantize_model(cl.StockGemmaLM(), recipe), stock_params)
  custom = grads(jqf.quantize_model(cl.GemmaStyleLM(), recipe), cl.as_custom_params(stock_params))
  plain = grads(cl.GemmaStyleLM(), cl.as_custom_params(stock_params))
  jax.tree.map(np.testing.assert_array_equal, custom, cl.as_custom_params(stock))
  # ...and they are FP8's, not the unquantized model's.
  assert not np.array_equal(
    custom["layer_0"]["mlp"]["linear"]["w"], plain["layer_0"]["mlp"]["linear"]["w"]
  )


def test_gemma_report_lists_attention_in_high_precision(gemma):
  params, data = gemma
  model = jqf.quantize_model(cl.GemmaStyleLM(), head_in_bf16(recipes.mxfp8_factory, cl.HEAD_ROLE))
  report = jqf.swap_report(model, {"params": params}, data[:, :-1])
  assert {r.role for r in report.quantized} == set(cl.GEMMA_ROLES) - {cl.HEAD_ROLE}
  assert all(r.quantizers["weight"] == recipes.mxfp8_factory(None) for r in report.quantized)
  (head,) = [r for r in report.rows if r.role == cl.HEAD_ROLE]
  assert head.status == "high precision: the recipe maps it to None"
  assert head.call == "dot 'abc,cd->abd'" and head.shapes == ((4, 16, 64), (64, 64))
  activations = [r for r in report.rows if r.role is None]
  assert [r.call for r in activations] == ["einsum 'BTNH,BSNH->BNTS'", "einsum 'BNTS,BSNH->BTNH'"]
  assert all(r.status == "high precision: not a weight GEMM" for r in activations)
  assert all(r.path == "" for r in activations)
  text = str(report)
  assert "layer_0/mlp/gating_einsum" in text and "not a weight GEMM" in text


# ---- No silent no-op; shapes that do not fit ----


class NoWeightGemm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    return jnp.einsum("bd,cd->bc", x * scale, x)


def test_a_quantizing_recipe_with_no_reachable_gemm_raises():
  x = jnp.ones((32, 64))
  with pytest.raises(ValueError, match=r"'mxfp8' quantizes.*no GEMM.*require_gemm=False"):
    jax.eval_shape(jqf.quantize_model(NoWeightGemm(), recipes.mxfp8).init, jax.random.key(0), x)
  jax.eval_shape(jqf.quantize_model(NoWeightGemm(), recipes.bf16).init, jax.random.key(0), x)
  jax.eval_shape(
    jqf.quantize_model(NoWeightGemm(), recipes.mxfp8, require_gemm=False).init, jax.random.key(0), x
  )


class NarrowHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = cl.Einsum((64, 64), ("embed", "mlp"), name="proj")("bd,df->bf", x)
    return cl.Einsum((64, 10), ("mlp", "vocab"), name="head")("bf,fv->bv", h)


def test_unfit_shape_raises_or_runs_in_high_precision():
  """A 10-wide head under a user's MXFP8 recipe (the presets keep it, a tiny GEMM, in high
  precision): its weight's columnwise blocks (backward) run along N, checked at the first
  call."""
  x = jnp.ones((32, 64), jnp.bfloat16)
  mxfp8 = recipes.CustomRecipe(recipes.mxfp8_factory)
  model = jqf.quantize_model(NarrowHead(), mxfp8)
  with pytest.raises(ValueError, match=r"'head/w'.*dim N .* = 10.*on_unfit='high_precision'"):
    jax.eval_shape(model.init, jax.random.key(0), x)
  model = jqf.quantize_model(NarrowHead(), mxfp8, on_unfit="high_precision")
  variables = jax.jit(model.init)(jax.random.key(0), x)
  report = jqf.swap_report(model, variables, x)
  assert [r.role for r in report.quantized] == ["proj/w"]
  (head,) = report.high_precision
  assert head.role == "head/w" and head.status.startswith("high precision: the shape does not fit")
  plain = cl.Einsum((64, 10), ("mlp", "vocab")).apply(
    {"params": variables["params"]["head"]},
    "bf,fv->bv",
    cl.Einsum((64, 64), ("embed", "mlp"), name="proj").apply(
      {"params": variables["params"]["proj"]}, "bd,df->bf", x
    ),
  )
  assert not np.array_equal(jax.jit(model.apply)(variables, x), plain)  # proj is quantized
  with pytest.raises(ValueError, match="on_unfit"):
    jqf.quantize_model(NarrowHead(), recipes.mxfp8, on_unfit="ignore")


# ---- Batched (per-expert) weights: grouped GEMMs ----


class Experts(nn.Module):
  @nn.compact
  def __call__(self, x):  # x [experts, tokens, d]
    w = self.param("experts", nn.initializers.normal(0.05), (4, 64, 32))
    return jnp.einsum("ETD,EDF->ETF", x, w)


@pytest.mark.slow
def test_per_expert_weights_run_as_grouped_gemm():
  x = jax.random.normal(jax.random.key(1), (4, 32, 64), jnp.bfloat16)
  seen = []
  recipe = recipes.CustomRecipe(lambda role: seen.append(role) or recipes.fp8_current_factory(role))
  model = jqf.quantize_model(Experts(), recipe)
  variables = model.init(jax.random.key(0), x)  # eagerly: the param matched by its values
  assert {r.module_type for r in seen} == {"grouped_linear"}

  @jax.jit
  def each_expert_alone(x, w):  # the einsum promotes x to w's fp32
    return jnp.stack(
      [
        ops.grouped_dense(
          x[e].astype(w.dtype), w[e][None], jnp.array([32]), recipe=recipes.fp8_current
        )
        for e in range(4)
      ]
    )

  np.testing.assert_array_equal(
    jax.jit(model.apply)(variables, x), each_expert_alone(x, variables["params"]["experts"])
  )


# ---- (b) MaxText style: lax.dot_general routed, and through MaxText's hook ----


@pytest.fixture(scope="module")
def maxtext():
  data = windows()
  params, _ = tt.linen_init(cl.MaxTextStyleLM(), data)
  return params, data


def maxtext_model(route, recipe):
  """route "swap": quantize_model of the plain model; "hook": MaxText's `quant=`."""
  if route == "swap":
    return jqf.quantize_model(cl.MaxTextStyleLM(), recipe)
  return cl.MaxTextStyleLM(quant=jqf.MaxTextQuantization(recipe))


@pytest.mark.parametrize("route", ["swap", "hook"])
def test_maxtext_roles(route):
  seen = []
  recording = recipes.CustomRecipe(lambda role: seen.append(role))
  jax.eval_shape(maxtext_model(route, recording).init, jax.random.key(0), windows()[:, :-1])
  assert len(seen) == 3 * len(cl.MAXTEXT_ROLES)
  assert {(r.name, r.tensor_type) for r in seen} == {
    (n, t) for n in cl.MAXTEXT_ROLES for t in ("input", "weight", "grad_output")
  }


@pytest.mark.parametrize("route", ["swap", "hook"])
def test_maxtext_bf16_is_the_plain_model(maxtext, route):
  params, data = maxtext
  plain = jax.jit(cl.MaxTextStyleLM().apply)({"params": params}, data[:, :-1])
  model = maxtext_model(route, recipes.bf16)
  np.testing.assert_array_equal(jax.jit(model.apply)({"params": params}, data[:, :-1]), plain)


# The hook's GEMMs are the swap's, bit for bit (the grads test below): it trains under one
# recipe here, the swap under both (each NVFP4 step costs a minute to compile on CI).
@pytest.mark.parametrize(
  "route, factory",
  [("swap", f) for f in TRAINED] + [("hook", TRAINED[0])],
  ids=lambda v: getattr(v, "__name__", v),
)
@pytest.mark.slow
def test_maxtext_trains(maxtext, route, factory):
  params, data = maxtext
  model = maxtext_model(route, head_in_bf16(factory, cl.MAXTEXT_HEAD_ROLE))
  losses, _ = tt.train_linen(model, params, {}, STEPS, data)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-3:]) < 0.8 * losses[0], losses


@pytest.mark.slow
def test_maxtext_fp8_grads_equal_stock_layers(maxtext):
  """Both routes give the grads of the same weights in stock nn.DenseGeneral layers."""
  params, data = maxtext
  recipe = head_in_bf16(recipes.fp8_current_factory, cl.MAXTEXT_HEAD_ROLE)

  def grads(model):
    loss = lambda p: tt.xent(model.apply({"params": p}, data[:, :-1]), data)
    return jax.jit(jax.grad(loss))(params)

  stock = grads(jqf.quantize_model(cl.MaxTextStyleLM(stock=True), recipe))
  for route in ("swap", "hook"):
    jax.tree.map(np.testing.assert_array_equal, grads(maxtext_model(route, recipe)), stock)

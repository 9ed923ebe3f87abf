"""A plain-JAX GPT (params dict, `jnp.einsum` attention, `lax.scan` over its layers) under
`jaxquant.quantize`: bf16 changes nothing, every preset but the NVFP4 ones trains (those
train on the Equinox MLP, `test_equinox.py`), the quantized output is the Flax twin's
under the swap-in bit for bit, and policies key on the params' paths."""

import jax
import numpy as np
import pytest
from function_models import FlaxGpt, gpt, gpt_batch, gpt_loss, gpt_params
from function_training import assert_trains, train

import jaxquant
import jaxquant.flax as jqf
from jaxquant import functional as jqfn
from jaxquant import recipes

WEIGHTS = ("layers/w_qkv", "layers/w_o", "layers/w_in", "layers/w_out", "head")


@pytest.fixture(scope="module")
def params():
  return gpt_params(jax.random.key(0))


def test_bf16_is_the_function_bit_for_bit(params):
  tokens = gpt_batch()
  qfn = jaxquant.quantize(gpt, "bf16")
  loss = lambda f: lambda p: gpt_loss(f(p, tokens), tokens)
  out, grads = jax.jit(jax.value_and_grad(loss(qfn)))(params)
  want, want_grads = jax.jit(jax.value_and_grad(loss(gpt)))(params)
  np.testing.assert_array_equal(out, want)
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "mxfp8"])
def test_quantized_output_is_the_flax_swap_in_s_bit_for_bit(params, recipe):
  tokens = gpt_batch()
  qfn = jaxquant.quantize(gpt, recipe)
  state = qfn.init(params, tokens)
  out, _ = jax.jit(lambda p, s: qfn.apply(p, tokens, state=s))(params, state)
  model = jqf.quantize_model(FlaxGpt(), recipe)
  collections = {c: v for c, v in model.init(jax.random.key(0), tokens).items() if c != "params"}
  apply = lambda p, c: model.apply({"params": p, **c}, tokens, mutable=True)[0]
  flax_out = jax.jit(apply)(params, collections)
  assert not np.array_equal(out, gpt(params, tokens))  # quantized for real
  np.testing.assert_array_equal(out, flax_out)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_current", "fp8_delayed", "mxfp8"])
def test_trains_under_the_preset(params, recipe):
  losses, state = train(jaxquant.quantize(gpt, recipe), params, gpt_batch(), gpt_loss)
  assert_trains(losses)
  if recipe == "fp8_delayed":
    assert sorted(state) == sorted(WEIGHTS[:4] + ("head",))
    scale = state["layers/w_in"]["input"].scaling.scale
    assert scale.shape == (2,)  # one per scanned layer
    assert np.all(np.asarray(scale) != 1.0)  # advanced from the initial scale
  else:
    assert state == {}


def test_swap_report_names_the_roles_by_param_path(params):
  report = jqfn.swap_report(jaxquant.quantize(gpt, "mxfp8"), params, gpt_batch())
  assert [r.role for r in report.quantized] == list(WEIGHTS)
  assert [r.call for r in report.high_precision] == [
    "einsum 'bthe,bshe->bhts'",
    "einsum 'bhts,bshe->bthe'",
  ]
  assert "layers/w_qkv" in str(report)


def test_policies_key_on_param_paths(params):
  seen = set()

  def policy(role):
    seen.add(role.name)
    if role.name in ("head", "layers/w_out"):
      return None
    return recipes.mxfp8_factory(role)

  qfn = jaxquant.quantize(gpt, recipes.CustomRecipe(policy))
  report = jqfn.swap_report(qfn, params, gpt_batch())
  assert seen == set(WEIGHTS)
  kept = {r.role: r.status for r in report.rows if r.role in ("head", "layers/w_out")}
  assert kept == dict.fromkeys(kept, "high precision: the recipe maps it to None")
  assert sorted(kept) == ["head", "layers/w_out"]
  assert [r.role for r in report.quantized] == ["layers/w_qkv", "layers/w_o", "layers/w_in"]

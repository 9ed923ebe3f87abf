"""The NNX side: Linear / Einsum, swap-in on a plain NNX Transformer, state, metadata."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_transformers as tt
from flax import nnx

import jaxquant.flax as jqf
import jaxquant.flax.nnx as jqnnx
from jaxquant import recipes

STEPS = 30


def first_and_last_in_bf16(role):
  if role.name.startswith("layers/0/") or role.name == "head":
    return None
  return recipes.fp8_current_factory(role)


CUSTOM = recipes.CustomRecipe(first_and_last_in_bf16, name="first_last_bf16")


@pytest.fixture(scope="module")
def plain_losses():
  return tt.train_nnx(tt.NnxLM(nnx.Rngs(0)), STEPS, tt.batch())


# test_linen_swap trains under every preset. Here, the recipes that take the NNX modules'
# own paths: none (bf16, equal to the plain model), quantization state (fp8_delayed), the
# rngs of stochastic rounding (nvfp4) and a per-role callback. Each case costs 10-50 s of
# compilation on a CPU, and CI runs on two cores.
@pytest.mark.parametrize(
  "recipe", [recipes.bf16, recipes.fp8_delayed, recipes.nvfp4, CUSTOM], ids=lambda r: r.name
)
@pytest.mark.slow
def test_trains_under_recipe(plain_losses, recipe):
  plain = tt.NnxLM(nnx.Rngs(0))
  params = nnx.state(plain, nnx.Param)
  model = jqf.quantize_model(tt.NnxLM(nnx.Rngs(0)), recipe, rngs=nnx.Rngs(quant=1))
  assert type(model.layers[0].mlp.wi) is jqnnx.Linear
  assert type(model.layers[0].attention.out) is jqnnx.Einsum
  assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(params)
  has_state = bool(jax.tree.leaves(nnx.state(model, jqf.QuantState)))
  assert has_state == (recipe is recipes.fp8_delayed)
  losses = tt.train_nnx(model, STEPS, tt.batch())
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
  if recipe is recipes.bf16:
    assert losses == plain_losses
  if recipe is recipes.fp8_delayed:
    for s in jax.tree.leaves(nnx.state(model, jqf.QuantState), is_leaf=jqf.is_role_state):
      assert s.scaling.scale != 1.0 and s.scaling.amax_history[-1] > 0, s.role


@pytest.mark.slow
def test_scanned_remat_state_is_per_layer_and_advances_once_per_step():
  model = jqf.quantize_model(tt.NnxScannedLM(nnx.Rngs(0)), recipes.fp8_delayed)
  states = jax.tree.leaves(nnx.state(model, jqf.QuantState), is_leaf=jqf.is_role_state)
  assert len(states) == 3 * (len(tt.BLOCK_GEMMS) + 1)  # the stacked block's GEMMs, the head
  scanned = model.layers.mlp.wi.quant_state.get_value()
  assert scanned["input"].scaling.amax_history.shape == (tt.LAYERS, 1024)
  assert scanned["input"].role.name == "layers/mlp/wi"
  losses = tt.train_nnx(model, 2, tt.batch())
  assert np.all(np.isfinite(losses))
  for state in jax.tree.leaves(nnx.state(model.layers, jqf.QuantState), is_leaf=jqf.is_role_state):
    hist = state.scaling.amax_history
    # Two updates: the two recorded amaxes rolled to the end, slot 0 cleared, per layer.
    assert np.all(hist[:, -2:] > 0) and np.all(hist[:, :-2] == 0), state.role
    assert np.all(state.scaling.scale != 1.0), state.role  # grad_output's included
    if state.role.tensor_type != "weight":
      assert not np.array_equal(hist[0], hist[1]), state.role


def test_swap_shares_the_param_variables_and_sees_every_role():
  seen = []
  plain = tt.NnxLM(nnx.Rngs(0))
  kernel = plain.layers[1].mlp.wo.kernel
  model = jqf.quantize_model(plain, recipes.CustomRecipe(lambda role: seen.append(role)))
  assert model.layers[1].mlp.wo.kernel is kernel
  model(tt.batch()[:, :-1])
  assert len(seen) == 2 * 3 * len(tt.NNX_GEMM_PATHS)  # at bind and at call
  assert {r.name for r in seen} == set(tt.NNX_GEMM_PATHS)


def test_params_interchange_and_annotations():
  tokens = tt.batch()[:, :-1]
  plain = tt.NnxLM(nnx.Rngs(0))
  model = jqf.quantize_model(tt.NnxLM(nnx.Rngs(5)), CUSTOM, annotate=True, rngs=nnx.Rngs(quant=0))
  roles = jqf.weight_roles(model)  # (nnx.update with a plain state replaces metadata too)
  bf16_model = jqf.quantize_model(tt.NnxLM(nnx.Rngs(5)), recipes.bf16)
  nnx.update(bf16_model, nnx.state(plain, nnx.Param))
  np.testing.assert_array_equal(bf16_model(tokens), plain(tokens))
  assert sorted(roles) == sorted(f"{p}/kernel" for p in tt.NNX_GEMM_PATHS)
  assert roles["head/kernel"][1] is None and roles["layers/0/mlp/wi/kernel"][1] is None
  assert roles["layers/1/mlp/wi/kernel"][1] == recipes.fp8_current_factory(
    roles["layers/1/mlp/wi/kernel"][0]
  )


def test_native_layers_bf16_bit_identical_to_flax():
  x = jax.random.normal(jax.random.key(1), (4, 8, 32), jnp.bfloat16)
  pairs = [
    (nnx.Linear(32, 16, rngs=nnx.Rngs(0)), jqnnx.Linear(32, 16, rngs=nnx.Rngs(0))),
    (
      nnx.Einsum("bsk,kn->bsn", (32, 16), (16,), rngs=nnx.Rngs(0)),
      jqnnx.Einsum("bsk,kn->bsn", (32, 16), (16,), rngs=nnx.Rngs(0)),
    ),
  ]
  for flax_layer, layer in pairs:
    grad = lambda m: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)
    np.testing.assert_array_equal(layer(x), flax_layer(x))
    jax.tree.map(np.testing.assert_array_equal, grad(layer), grad(flax_layer))


def test_native_layer_with_recipe_and_errors():
  layer = jqnnx.Linear(40, 32, recipe=recipes.mxfp8, name="proj", rngs=nnx.Rngs(0))
  assert jqf.weight_roles(layer)["kernel"][1] == recipes.mxfp8_factory(None)
  with pytest.raises(ValueError, match=r"'proj'.*K \(contraction\) = 40"):
    layer(jnp.ones((32, 40)))
  unstated = jqnnx.Linear(32, 32, name="proj", rngs=nnx.Rngs(0))
  with recipes.autocast(recipes.fp8_delayed):
    with pytest.raises(ValueError, match="'proj'.*no state"):
      unstated(jnp.ones((32, 32)))

"""Swap-in on a plain Linen Transformer: training under every preset, roles, params."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_transformers as tt

import jaxquant.flax as jqf
from jaxquant import recipes
from jaxquant.quantizers import Float8Quantizer, MXFP8Quantizer

STEPS = 30


def first_and_last_in_bf16(role):
  """Layer 0 and the head in bf16, the rest FP8 with current scaling (the preset's
  choices; the NVFP4 presets are trained above, and cost three times its compile)."""
  if role.name.startswith("layer_0/") or role.name == "head":
    return None
  return recipes.fp8_current_factory(role)


CUSTOM = recipes.CustomRecipe(first_and_last_in_bf16, name="first_last_bf16")
# One recipe a way the swap-in treats a recipe: nothing quantized, per-tensor scales, state
# (fp8_delayed), random keys (nvfp4's stochastic rounding), a format per usage (hybrid, whose
# forward is MXFP8) and a per-role policy. Block FP8 and MXFP8 differ from fp8_current only
# inside their quantizers, which tests/reference and tests/ops check bit for bit; each NVFP4
# or MXFP8 step here costs half a minute of CI's CPU to compile.
RECIPES = [
  recipes.bf16,
  recipes.fp8_current,
  recipes.fp8_delayed,
  recipes.nvfp4,
  recipes.hybrid,
  CUSTOM,
]


@pytest.fixture(scope="module")
def plain():
  windows = tt.batch()
  params, _ = tt.linen_init(tt.LinenLM(), windows)
  losses, _ = tt.train_linen(tt.LinenLM(), params, {}, STEPS, windows)
  return params, losses, windows


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.slow
def test_trains_under_recipe(plain, recipe):
  params, plain_losses, windows = plain
  model = jqf.quantize_model(tt.LinenLM(), recipe)
  # Traced, not compiled: a jitted init would compile the quantized forward once more.
  abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), windows[:, :-1]))
  assert jax.tree.map(jnp.shape, abstract.pop("params")) == jax.tree.map(jnp.shape, params)
  assert set(abstract) == ({"quant_state"} if recipe is recipes.fp8_delayed else set())
  # The plain model's params (they interchange); only delayed scaling needs its state.
  collections = tt.linen_init(model, windows)[1] if abstract else {}
  losses, _ = tt.train_linen(model, params, collections, STEPS, windows)
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.7 * losses[0], losses
  if recipe is recipes.bf16:
    assert losses == plain_losses  # bit-identical to the unswapped model
  else:
    np.testing.assert_allclose(losses[0], plain_losses[0], rtol=0.05)


def test_recipe_sees_every_role_once_per_trace():
  seen = []
  recording = recipes.CustomRecipe(lambda role: seen.append(role))
  jax.eval_shape(
    jqf.quantize_model(tt.LinenLM(), recording).init, jax.random.key(0), tt.batch()[:, :-1]
  )
  assert len(seen) == 3 * len(tt.GEMM_PATHS)
  assert {r.name for r in seen} == set(tt.GEMM_PATHS)
  assert {(r.name, r.tensor_type) for r in seen} == {
    (p, t) for p in tt.GEMM_PATHS for t in ("input", "weight", "grad_output")
  }
  assert {r.module_type for r in seen} == {"linear"}


@pytest.mark.slow
def test_params_interchange_both_ways():
  windows = tt.batch()
  tokens = windows[:, :-1]
  plain_model, swapped = tt.LinenLM(), jqf.quantize_model(tt.LinenLM(), recipes.bf16, annotate=True)
  plain_params, _ = tt.linen_init(plain_model, windows)
  boxed = jax.jit(swapped.init)(jax.random.key(0), tokens)["params"]
  swapped_params = nn.unbox(boxed)
  # Same initializers, same RNG streams: the same params.
  jax.tree.map(np.testing.assert_array_equal, swapped_params, plain_params)
  y_plain = plain_model.apply({"params": plain_params}, tokens)
  np.testing.assert_array_equal(swapped.apply({"params": plain_params}, tokens), y_plain)
  np.testing.assert_array_equal(plain_model.apply({"params": swapped_params}, tokens), y_plain)
  # annotate=True: every GEMM weight names its role; bf16 quantizes none of them.
  roles = jqf.weight_roles(boxed)
  assert sorted(roles) == sorted(f"{p}/kernel" for p in tt.GEMM_PATHS)
  assert all(
    r.tensor_type == "weight" and f"{r.name}/kernel" == path and q is None
    for path, (r, q) in roles.items()
  )


def test_model_recipe_module_recipe_and_autocast():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(32, name="plain")(x)
      return jqf.linen.Dense(32, name="own", recipe=recipes.mxfp8)(x)

  x = jnp.ones((32, 32))

  def weight_quantizers(model):
    boxed = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    return {path: q for path, (_, q) in jqf.weight_roles(boxed).items()}

  model = Model()
  with recipes.autocast(recipes.fp8_current):
    assert weight_quantizers(jqf.quantize_model(model, annotate=True)) == {
      "plain/kernel": Float8Quantizer("e4m3"),
      "own/kernel": MXFP8Quantizer("e4m3"),
    }
    assert weight_quantizers(jqf.quantize_model(model, recipes.bf16, annotate=True)) == {
      "plain/kernel": None,
      "own/kernel": MXFP8Quantizer("e4m3"),
    }


def test_invalid_quantizer_names_the_module_path():
  bad = recipes.CustomRecipe(lambda role: "e4m3" if role.name == "layer_1/mlp/wo" else None)
  with pytest.raises(TypeError, match="layer_1/mlp/wo"):
    jax.eval_shape(
      jqf.quantize_model(tt.LinenLM(), bad).init, jax.random.key(0), tt.batch()[:, :-1]
    )


def test_quantizer_that_does_not_fit_a_dim_names_module_and_dim():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, name="proj")(x)

  with pytest.raises(ValueError, match=r"'proj'.*input.*K \(contraction\) = 40.*32"):
    jax.eval_shape(
      jqf.quantize_model(Model(), recipes.mxfp8).init, jax.random.key(0), jnp.ones((32, 40))
    )


@pytest.mark.slow
def test_few_tokens_run_forward_and_are_refused_for_training():
  """Inference of 8 tokens under MXFP8 needs no columnwise blocks along the tokens; a
  gradient does, and its error names the layer and the rule."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral(32, name="proj")(x)

  model = jqf.quantize_model(Model(), recipes.mxfp8)
  x = jnp.ones((8, 64))
  params = model.init(jax.random.key(0), x)
  assert model.apply(params, x).shape == (8, 32)
  loss = lambda p: jnp.sum(model.apply(p, x))
  with pytest.raises(
    ValueError, match=r"'proj'.*input: columnwise usage.*divisible by its block 32"
  ):
    jax.grad(loss)(params)


def test_batched_einsum_is_rejected_when_quantized_but_runs_in_bf16():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Einsum((4, 32, 32), "bik,bkn->bin", name="batched")(x)

  x = jnp.ones((4, 32, 32))
  jax.eval_shape(jqf.quantize_model(Model(), recipes.bf16).init, jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"'batched'.*batch axes \['b'\]"):
    jax.eval_shape(jqf.quantize_model(Model(), recipes.mxfp8).init, jax.random.key(0), x)

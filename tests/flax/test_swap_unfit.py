"""GEMMs whose shape a format's blocks do not tile, under the swap-in.

A gemma-4-style MoE block: a router of 4 experts (`einsum` of the tokens with a [D, 4]
param: N = 4, less than one block of MXFP8 or NVFP4) and experts as ragged dots. The
presets keep such tiny GEMMs in high precision (a row of `swap_report` says why) and
train; a user's recipe that does not opt in refuses it, forward or backward, with an
error naming the role and `on_unfit='high_precision'`, as every unfit-shape error of the
swap-in does."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

TOKENS, D, EXPERTS, TOP_K = 32, 64, 4, 2
X = jax.random.normal(jax.random.key(1), (TOKENS, D), jnp.float32)
ERROR_HINT = r"on_unfit='high_precision'"


def moe(x, router, experts_kernel):
  """Router einsum, top-k, tokens sorted by expert, a ragged dot of the experts' kernels
  (one stands for gemma's gate, up and down projections: the same call)."""
  logits = jnp.einsum("td,de->te", x, router)
  weights, experts = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = jnp.repeat(x, TOP_K, axis=0)[order]
  group_sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
  y = jax.lax.ragged_dot(rows, experts_kernel, group_sizes)
  y = jnp.zeros_like(y).at[order].set(y)
  return (y.reshape(x.shape[0], TOP_K, -1) * weights[..., None]).sum(1)


class LinenMoE(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.normal(0.05)
    router = self.param("router", init, (D, EXPERTS))
    return x + moe(x, router, self.param("experts", init, (EXPERTS, D, D)))


class LinenLM(nn.Module):
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(LinenMoE) if self.remat else LinenMoE
    return nn.Dense(D, name="out")(block(name="moe")(x))


class NnxMoE(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.normal(0.05)
    self.router = nnx.Param(init(rngs.params(), (D, EXPERTS)))
    self.experts = nnx.Param(init(rngs.params(), (EXPERTS, D, D)))

  def __call__(self, x):
    return x + moe(x, self.router[...], self.experts[...])


class NnxLM(nnx.Module):
  def __init__(self, rngs):
    self.moe = NnxMoE(rngs)
    self.out = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return self.out(self.moe(x))


def train_linen(model, variables, steps=2):
  def loss(params, key):
    y = model.apply({"params": params}, X, rngs={"quant": key})
    return jnp.mean(y.astype(jnp.float32) ** 2)

  step = jax.jit(jax.value_and_grad(loss))
  params, losses = variables["params"], []
  for i in range(steps):
    value, grads = step(params, jax.random.key(i))
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    losses.append(float(value))
  return losses


def train_nnx(model, steps=2):
  @nnx.jit
  def step(model):
    value, grads = nnx.value_and_grad(lambda m: jnp.mean(m(X) ** 2))(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return value

  return [float(step(model)) for _ in range(steps)]


def _status(report) -> dict:
  return {r.role: r.status for r in report.rows if r.is_weight_gemm}


BLOCK = {"mxfp8": 32, "nvfp4": 16}


@pytest.fixture(scope="module")
def variables():
  # The quantized model's own: the same tree. Jitted: one program, not op by op.
  return jax.jit(LinenLM().init)(jax.random.key(0), X)


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4"])
def test_linen_presets_train_with_a_tiny_router_in_high_precision(preset, variables):
  model = jqf.quantize_model(LinenLM(), preset)
  losses = train_linen(model, variables)
  assert all(np.isfinite(losses)) and losses[1] < losses[0]
  report = jqf.swap_report(model, variables, X)
  status = _status(report)
  assert status["moe/router"] == (
    f"high precision: N={EXPERTS} is smaller than one block ({BLOCK[preset]}) of {preset}"
  )
  assert status["moe/experts"] == status["out"] == "quantized"
  assert_no_quantizers_shown(report, "moe/router")


def assert_no_quantizers_shown(report, role):
  """A weight GEMM kept in high precision lists no quantizers, in its row or the table."""
  (row,) = [r for r in report.rows if r.role == role]
  assert row.quantizers is None
  (line,) = [line for line in str(report).splitlines() if f" {role} " in line]
  assert "Quantizer" not in line


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4"])
def test_nnx_presets_train_with_a_tiny_router_in_high_precision(preset):
  model = jqf.quantize_model(NnxLM(nnx.Rngs(0)), preset, rngs=nnx.Rngs(quant=0))
  losses = train_nnx(model)
  assert all(np.isfinite(losses)) and losses[1] < losses[0]
  report = jqf.swap_report(model, X)
  status = _status(report)
  assert status["moe/router"].startswith(f"high precision: N={EXPERTS} is smaller than one block")
  assert status["moe/experts"] == status["out"] == "quantized"
  assert_no_quantizers_shown(report, "moe/router")


def test_the_tiny_rule_keeps_every_gemm_that_fits_as_it_was(variables):
  """The preset's GEMMs that fit are bit for bit those of the same quantizers without the
  rule, the router mapped to None by hand."""
  by_hand = recipes.CustomRecipe(
    lambda role: None if role.name == "moe/router" else recipes.mxfp8_factory(role)
  )
  loss = lambda recipe: jax.value_and_grad(
    lambda p: jnp.sum(jqf.quantize_model(LinenLM(), recipe).apply({"params": p}, X) ** 2)
  )
  # Both in one program: one compilation, where XLA may merge what the two compute alike.
  preset, hand = jax.jit(lambda p: (loss(recipes.mxfp8)(p), loss(by_hand)(p)))(variables["params"])
  jax.tree.map(np.testing.assert_array_equal, preset, hand)


# A user's recipe keeps its behaviour: a tiny GEMM is unfit like any other.
MY_MXFP8 = recipes.CustomRecipe(recipes.mxfp8_factory, name="my_mxfp8")


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_a_custom_recipe_refuses_the_tiny_router_naming_role_and_option(remat):
  model = jqf.quantize_model(LinenLM(remat=remat), MY_MXFP8)
  with pytest.raises(ValueError, match=rf"'moe/router'.*{ERROR_HINT}"):
    variables = model.init(jax.random.key(0), X)
    train_linen(model, variables)


def test_nnx_custom_recipe_refuses_the_tiny_router_naming_role_and_option():
  model = jqf.quantize_model(NnxLM(nnx.Rngs(0)), MY_MXFP8)
  with pytest.raises(ValueError, match=rf"'moe/router'.*{ERROR_HINT}"):
    train_nnx(model)


def test_a_custom_recipe_opts_in_to_the_tiny_rule(variables):
  opted = dataclasses.replace(MY_MXFP8, tiny_gemms_in_high_precision=True)
  model = jqf.quantize_model(LinenLM(), opted)
  status = _status(jqf.swap_report(model, variables, X))
  assert (
    status["moe/router"] == f"high precision: N={EXPERTS} is smaller than one block (32) of mxfp8"
  )
  # With the option off again, on_unfit="high_precision" still takes it, as before.
  model = jqf.quantize_model(LinenLM(), MY_MXFP8, on_unfit="high_precision")
  status = _status(jqf.swap_report(model, variables, X))
  assert status["moe/router"].startswith("high precision: the shape does not fit")


def test_presets_opt_in_and_plain_recipes_do_not():
  for name, preset in recipes.PRESETS.items():
    assert preset.tiny_gemms_in_high_precision, name
  assert not recipes.CustomRecipe(recipes.mxfp8_factory).tiny_gemms_in_high_precision
  with pytest.raises(TypeError, match="tiny_gemms_in_high_precision"):
    recipes.CustomRecipe(recipes.mxfp8_factory, tiny_gemms_in_high_precision="yes")


# ---- Every unfit-shape error the swap-in raises names the role and the option. ----


class Wide(nn.Module):
  """Layers 48 wide: more than one MXFP8 block, not a multiple of it (not tiny)."""

  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "dense":
      return nn.Dense(48, name="proj")(x)
    if self.kind == "grouped":
      return jqf.GroupedDense(2, 48, name="proj")(x, jnp.array([16, 16], jnp.int32))
    w = self.param("proj", nn.initializers.normal(0.05), (D, 48))
    return jnp.einsum("td,df->tf", x, w)


@pytest.mark.parametrize("kind", ["dense", "grouped", "einsum"])
def test_unfit_weight_errors_name_role_and_option_in_training(kind):
  model = jqf.quantize_model(Wide(kind), recipes.mxfp8)
  with pytest.raises(ValueError, match=rf"'proj'.*{ERROR_HINT}"):
    variables = model.init(jax.random.key(0), X)
    train_linen(model, variables)


def test_unfit_token_count_in_the_backward_names_role_and_option():
  """M = 8 tokens fit the forward (blocks along K) but not wgrad's columnwise blocks along
  M: the backward's error names the role and the option too."""
  x = X[:8]
  layer = jqf.quantize_model(nn.Sequential([nn.Dense(64)]), MY_MXFP8)
  variables = nn.Sequential([nn.Dense(64)]).init(jax.random.key(0), x)
  jax.jit(layer.apply)(variables, x)  # few-token inference runs
  loss = lambda p: jnp.sum(layer.apply({"params": p}, x) ** 2)
  with pytest.raises(ValueError, match=rf"'layers_0'.*{ERROR_HINT}"):
    jax.grad(loss)(variables["params"])

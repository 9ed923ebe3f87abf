"""The swap-in's options and the Flax layers' state errors: `on_unfit="high_precision"`,
nested quantized models, role names against param paths, delayed-scaling state that
cannot be written back or was restored without a target, preset names as recipes."""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer, MXFP8Quantizer

X = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32)
GROUPS = jnp.array([16, 16], jnp.int32)


def _roles(report) -> dict:
  """{role: weight quantizer} of a swap report's weight GEMMs."""
  return {r.role: (r.quantizers or {}).get("weight") for r in report.rows if r.is_weight_gemm}


def _status(report) -> dict:
  return {r.role: r.status for r in report.rows if r.is_weight_gemm}


# ---- on_unfit="high_precision": a 10-wide head under MXFP8 runs as the plain layer. ----

# MXFP8 without the presets' rule for tiny GEMMs (which would keep these heads in high
# precision before on_unfit is asked: tests/flax/test_swap_unfit.py).
MXFP8 = recipes.CustomRecipe(recipes.mxfp8_factory, name="mxfp8_as_any")


class LinenHeads(nn.Module):
  """Three stock layers, 10 wide (MXFP8 tiles 32), and a grouped one."""

  @nn.compact
  def __call__(self, x):
    return (
      nn.Dense(10, name="dense")(x),
      nn.DenseGeneral((2, 5), name="general")(x),
      nn.Einsum((64, 10), "bk,kn->bn", name="einsum")(x),
      jqf.GroupedDense(2, 10, name="grouped")(x, GROUPS),
    )


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_linen_unfit_layers_run_in_high_precision():
  model = jqf.quantize_model(LinenHeads(), MXFP8, on_unfit="high_precision")
  variables = model.init(jax.random.key(0), X)
  plain = LinenHeads().init(jax.random.key(0), X)
  assert jax.tree.map(jnp.shape, nn.unbox(variables)) == jax.tree.map(jnp.shape, nn.unbox(plain))
  got = model.apply(variables, X)
  # Bits of the plain layers (the grouped one's plain form: its bf16 recipe).
  with recipes.autocast(recipes.bf16):
    want = LinenHeads().apply(variables, X)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, w)
  status = _status(jqf.swap_report(model, variables, X))
  assert sorted(status) == ["dense", "einsum", "general", "grouped"]
  for role, why in status.items():
    assert why.startswith("high precision: the shape does not fit"), (role, why)
    assert "dim N (output features) = 10" in why, (role, why)


class NnxHeads(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(64, 10, rngs=rngs)
    self.einsum = nnx.Einsum("bk,kn->bn", (64, 10), (10,), rngs=rngs)
    self.grouped = jqf.NnxGroupedDense(64, 10, 2, rngs=rngs)

  def __call__(self, x):
    return self.dense(x), self.einsum(x), self.grouped(x, GROUPS)


def test_nnx_unfit_layers_run_in_high_precision():
  plain = NnxHeads(nnx.Rngs(0))
  with recipes.autocast(recipes.bf16):
    want = plain(X)
  model = jqf.quantize_model(NnxHeads(nnx.Rngs(0)), MXFP8, on_unfit="high_precision")
  for g, w in zip(model(X), want, strict=True):
    np.testing.assert_array_equal(g, w)
  status = _status(jqf.swap_report(model, X))
  assert sorted(status) == ["dense", "einsum", "grouped"]
  assert all("dim N (output features) = 10" in why for why in status.values()), status


# ---- Nested quantized models: the innermost one's recipe, for every contraction. ----


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (64, 64))
    return nn.Dense(64, name="fc")(x) @ w  # a stock layer and the model's own matmul


class LinenNested(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jqf.QuantizedModel(Block(name="inner"), recipes.fp8_current)(x)
    return nn.Dense(64, name="top")(x)


def test_linen_nested_models_take_the_innermost_recipe():
  model = jqf.quantize_model(LinenNested(), recipes.fp8_delayed)
  variables = model.init(jax.random.key(0), X)
  # Delayed-scaling state for the outer model's layer only, none for the inner ones.
  assert list(variables["quant_state"]) == ["top"]
  roles = _roles(jqf.swap_report(model, variables, X))
  assert roles == {
    "inner/fc": Float8Quantizer("e4m3"),
    "inner/w": Float8Quantizer("e4m3"),  # a param not named kernel keeps its name
    "top": DelayedFloat8Quantizer("e4m3"),
  }


class LinenOnlyNested(nn.Module):
  """Every weight GEMM inside a quantized submodel: the outer model met them through it."""

  @nn.compact
  def __call__(self, x):
    return jnp.tanh(jqf.QuantizedModel(Block(name="inner"), recipes.fp8_current)(x))


def test_linen_model_whose_gemms_are_all_in_a_quantized_submodel_is_no_no_op():
  model = jqf.quantize_model(LinenOnlyNested(), recipes.mxfp8)
  variables = model.init(jax.random.key(0), X)
  inner = jqf.QuantizedModel(Block(), recipes.fp8_current)
  want = jnp.tanh(inner.apply({"params": variables["params"]["inner"]}, X))
  np.testing.assert_array_equal(model.apply(variables, X), want)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(64, 64, rngs=rngs)
    self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 64)))

  def __call__(self, x):
    return self.fc(x) @ self.w[...]


class NnxNested(nnx.Module):
  def __init__(self, rngs):
    self.inner = jqf.quantize_model(NnxBlock(rngs), recipes.fp8_current)
    self.top = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    return self.top(self.inner(x))


class NnxOnlyNested(nnx.Module):
  def __init__(self, rngs):
    self.inner = jqf.quantize_model(NnxBlock(rngs), recipes.fp8_current)

  def __call__(self, x):
    return jnp.tanh(self.inner(x))


def test_nnx_model_whose_gemms_are_all_in_a_quantized_submodel_is_no_no_op():
  model = jqf.quantize_model(NnxOnlyNested(nnx.Rngs(0)), recipes.mxfp8)
  np.testing.assert_array_equal(model(X), jnp.tanh(model.inner(X)))


def test_nnx_nested_models_take_the_innermost_recipe():
  model = jqf.quantize_model(NnxNested(nnx.Rngs(0)), recipes.mxfp8)
  assert _roles(jqf.swap_report(model, X)) == {
    "inner/fc": Float8Quantizer("e4m3"),
    "inner/w": Float8Quantizer("e4m3"),  # a param not named kernel keeps its name
    "top": MXFP8Quantizer("e4m3"),
  }


# ---- Role names are param paths; the root module's weights go by their own name. ----


class LinenBackbone(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(64, name="fc")(x)


class LinenWithAttribute(nn.Module):
  backbone: nn.Module

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (64, 64))
    return self.backbone(x) @ w


def _param_roles(params) -> set:
  """The role each weight would be named by: its param path, the kernel's without its
  name; a root param by its own name."""
  paths = {"/".join(k.key for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
  return {p.removesuffix("/kernel") for p in paths if not p.endswith("bias")}


def test_linen_role_names_are_param_paths():
  model = jqf.quantize_model(LinenWithAttribute(backbone=LinenBackbone()), recipes.fp8_current)
  variables = model.init(jax.random.key(0), X)
  roles = _roles(jqf.swap_report(model, variables, X))
  assert set(roles) == _param_roles(variables["params"]) == {"backbone/fc", "w"}


class NnxWithAttribute(nnx.Module):
  def __init__(self, backbone, rngs):
    self.backbone = backbone
    self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 64)))

  def __call__(self, x):
    return self.backbone(x) @ self.w[...]


class NnxBackbone(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    return self.fc(x)


def test_nnx_role_names_are_param_paths():
  model = NnxWithAttribute(NnxBackbone(nnx.Rngs(0)), nnx.Rngs(1))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  model = jqf.quantize_model(model, recipes.fp8_current)
  roles = _roles(jqf.swap_report(model, X))
  assert set(roles) == _param_roles(params) == {"backbone/fc", "w"}


# ---- Delayed-scaling state that is not written back, or restored without a target. ----


class Delayed(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(), (64, 64))
    y = nn.Dense(64, name="fc")(x)  # a layer's call site
    return y @ w  # a routed contraction's (the state of the swap-in's host)


@pytest.fixture(scope="module")
def delayed():
  model = jqf.quantize_model(Delayed(), recipes.fp8_delayed)
  return model, model.init(jax.random.key(0), X)


def _call_sites(caught) -> set:
  return {(w.filename, w.lineno) for w in caught if "amaxes are dropped" in str(w.message)}


def test_immutable_quant_state_warns_once_per_call_site(delayed):
  model, variables = delayed
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    model.apply(variables, X)
    model.apply(variables, X)
  dropped = [w for w in caught if "amaxes are dropped" in str(w.message)]
  assert len(dropped) == 2 and len(_call_sites(dropped)) == 2, [str(w.message) for w in caught]
  assert {f for f, _ in _call_sites(dropped)} == {__file__}
  assert "mutable=['quant_state']" in str(dropped[0].message)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.apply(variables, X, mutable=["quant_state"])  # training: written back
    with jqf.linen.frozen_quant_state():  # forward-only evaluation, said so
      model.apply(variables, X)
      _, frozen = model.apply(variables, X, mutable=["quant_state"])
  assert not _call_sites(caught)
  same = jax.tree.map(np.array_equal, frozen["quant_state"], variables["quant_state"])
  assert all(jax.tree.leaves(same))  # frozen: nothing written back


def test_state_restored_without_target_is_refused_by_path(delayed, tmp_path):
  model, variables = delayed
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", variables)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "ckpt")  # no target: plain dicts
  with pytest.raises(TypeError, match=r"quant_state/fc/\w+ holds a dict.*StandardRestore"):
    model.apply(restored, X, mutable=["quant_state"])
  layer_restored = {"fc": variables["quant_state"]["fc"]}
  host_only = {**restored, "quant_state": {**restored["quant_state"], **layer_restored}}
  with pytest.raises(TypeError, match=r"quant_state/w_\w+ holds a dict.*target"):
    model.apply(host_only, X, mutable=["quant_state"])


def test_nnx_state_restored_without_target_is_refused():
  layer = jqf.nnx.Linear(64, 64, recipe=recipes.fp8_delayed, name="fc", rngs=nnx.Rngs(0))
  held = layer.quant_state.get_value()
  layer.quant_state.set_value(
    {t: {"scaling": dataclasses.asdict(s.scaling)} for t, s in held.items()}
  )
  with pytest.raises(TypeError, match=r"'fc'.*holds a dict.*target"):
    layer(X)


# ---- Preset names as recipes; anything else refused when it is given. ----


def test_preset_names_are_recipes():
  model = jqf.quantize_model(LinenBackbone(), "fp8_current")
  variables = model.init(jax.random.key(0), X)
  assert _roles(jqf.swap_report(model, variables, X)) == {"fc": Float8Quantizer("e4m3")}
  nnx_model = jqf.quantize_model(NnxBackbone(nnx.Rngs(0)), "mxfp8")
  assert _roles(jqf.swap_report(nnx_model, X)) == {"fc": MXFP8Quantizer("e4m3")}
  layer = jqf.linen.Dense(64, recipe="fp8_current")
  y = layer.apply(layer.init(jax.random.key(0), X), X)
  np.testing.assert_array_equal(
    y, jqf.linen.Dense(64, recipe=recipes.fp8_current).apply(layer.init(jax.random.key(0), X), X)
  )
  assert (
    jqf.nnx.Linear(64, 64, recipe="fp8_current", rngs=nnx.Rngs(0)).recipe is recipes.fp8_current
  )


def test_non_recipes_are_refused_when_given():
  with pytest.raises(TypeError):
    jqf.quantize_model(LinenBackbone(), 8)
  with pytest.raises(TypeError):
    jqf.quantize_model(NnxBackbone(nnx.Rngs(0)), recipes.fp8_current_factory)
  with pytest.raises(TypeError):
    jqf.nnx.Linear(64, 64, recipe=8, rngs=nnx.Rngs(0))
  layer = jqf.linen.Dense(64, recipe=8)
  with pytest.raises(TypeError):
    layer.init(jax.random.key(0), X)

"""`remat_policy` under `jax.checkpoint`: the backward pass of an MLP (dense, silu, dense)
recomputes no cast and no GEMM, keeps its activations as codes (not bf16), fewer bytes
than bf16 keeps without remat, and its gradients are those without remat, bit for bit,
under every preset."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _remat_checks import backward_work, kept_bytes, saved_residuals
from jax.ad_checkpoint import checkpoint_name

import jaxquant as jq
from jaxquant import kernels, recipes, scaling
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.ops import _operands as operands
from jaxquant.quantizers import needs_state
from jaxquant.roles import LINEAR

M, K, F = 128, 128, 256  # every preset's blocks tile these (block FP8: 128)
QUANTIZED = [name for name in recipes.PRESETS if name != "bf16"]
NARROW = {"f8_e4m3fn", "f8_e5m2", "u8"}  # FP8 codes, NVFP4's packed pairs


def _inputs(recipe: str):
  ks = jax.random.split(jax.random.key(0), 3)
  params = {
    "up": jax.random.normal(ks[0], (K, F)) / 8,
    "down": jax.random.normal(ks[1], (F, K)) / 8,
  }
  x = jax.random.normal(ks[2], (M, K), jnp.bfloat16)
  state = {}
  for layer in params:
    quantizers = recipes.get(recipe).quantizers(LINEAR, layer)
    state[layer] = {t: scaling.init_state(q) for t, q in quantizers.items() if needs_state(q)}
  return params, x, state


def _layer(name, x, params, state, recipe):
  # A key of its own per layer, for the presets that round stochastically.
  key = jax.random.fold_in(jax.random.key(7), ("up", "down").index(name))
  out = jq.dense(x, params[name], recipe=recipe, name=name, key=key, state=state[name] or None)
  return out[0] if state[name] else out


def _mlp(recipe: str):
  """loss(params, x, state): dense (up), silu, dense (down), mean square."""

  def loss(params, x, state):
    h = _layer("up", x, params, state, recipe)
    y = _layer("down", jax.nn.silu(h), params, state, recipe)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return loss


def _layer_loss(recipe: str):
  """loss(params, x, state) of the up layer alone, its output through silu."""

  def loss(params, x, state):
    h = _layer("up", x, params, state, recipe)
    return jnp.mean(jnp.square(jax.nn.silu(h).astype(jnp.float32)))

  return loss


def _grad(fn):
  return jax.grad(fn, argnums=(0, 1, 2))


@functools.partial(jax.jit, static_argnums=(0,))
def _grads_without_and_with_remat(recipe, params, x, state):
  """Both in one program: XLA shares their forward casts, which dominate compile time; a
  recomputation, were there one, would be kept apart by jax.checkpoint's barrier."""
  loss = _layer_loss(recipe)
  return _grad(loss)(params, x, state), _grad(jax.checkpoint(loss, policy=jq.remat_policy()))(
    params, x, state
  )


@pytest.mark.parametrize("recipe", list(recipes.PRESETS))
def test_gradients_are_bit_identical_with_and_without_remat(recipe):
  want, got = _grads_without_and_with_remat(recipe, *_inputs(recipe))
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("recipe", list(recipes.PRESETS))
def test_the_backward_recomputes_no_cast_and_no_gemm(recipe):
  loss = _mlp(recipe)
  args = _inputs(recipe)
  without_remat = backward_work(loss, *args)
  assert backward_work(jax.checkpoint(loss, policy=jq.remat_policy()), *args) == without_remat
  # The criterion sees a recomputation: with nothing saved, both layers' forwards
  # (casts and GEMMs) run again in the backward pass.
  full = backward_work(jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable), *args)
  assert full["gemms"] == without_remat["gemms"] + 2
  if recipe != "bf16":
    assert full["casts"] > without_remat["casts"]


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_the_policy_keeps_codes_not_bf16_and_fewer_bytes_than_bf16(recipe):
  if any(
    operands.takes_gemm_values(recipes.get(recipe).quantizers(LINEAR, layer), "quantized", *dims)
    for layer, dims in (("up", (M, K, F)), ("down", (M, F, K)))
  ):  # a GPU without this format's tensor cores: test_gemm_values_are_kept_as_values
    pytest.skip(f"{recipe}'s layers keep the bf16 values their GEMMs multiply here")
  loss = jax.checkpoint(_mlp(recipe), policy=jq.remat_policy())
  kept = saved_residuals(loss, *_inputs(recipe))
  # Both layers' inputs (x, silu(h)) and weights as codes, with their scales ...
  for role in ("input", "weight"):
    codes = [r for r in kept if r.name == f"jaxquant.{role}_codes"]
    assert len(codes) == 2 and {r.dtype for r in codes} <= NARROW, codes
    assert any(r.name == f"jaxquant.{role}_scales" for r in kept)
  # ... and besides them only the outputs the backward reads (h for silu, y for the
  # square), in bf16: no bf16 or fp32 copy of an input.
  others = [r for r in kept if not r.argument and not (r.name or "").endswith(("codes", "scales"))]
  assert sorted((r.name, r.dtype, r.shape) for r in others) == [
    ("jaxquant.output", "bf16", (M, K)),
    ("jaxquant.output", "bf16", (M, F)),
  ]
  bf16 = kept_bytes(saved_residuals(_mlp("bf16"), *_inputs("bf16")))
  assert kept_bytes(kept) < bf16


@pytest.fixture
def gpu_routes(monkeypatch, cuda_library_stand_in):
  """The kernels' availability and the GPU's GEMM routes, on this machine (as
  tests/ops/test_dense_gemm_values.py stands them in): MXFP8 and NVFP4 layers then cast
  straight to GEMM values."""
  monkeypatch.setattr(kernels, "available", lambda: True)
  select = gemm_ops.select
  monkeypatch.setattr(
    gemm_ops, "select", lambda problem, _, backend: select(problem, "gpu", backend)
  )


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_gemm_values_are_kept_as_values(gpu_routes, recipe):
  """Where the GEMMs dequantize first, the layers keep the bf16 values they multiply
  (NVFP4: and the global amaxes), as many bytes as bf16's, and cast nothing again."""
  loss = _mlp(recipe)
  args = _inputs(recipe)
  remat = jax.checkpoint(loss, policy=jq.remat_policy())
  kept = saved_residuals(remat, *args)
  for role in ("input", "weight"):
    assert [r.dtype for r in kept if r.name == f"jaxquant.{role}_values"] == ["bf16"] * 2
    assert not [r for r in kept if r.name == f"jaxquant.{role}_codes"]
  assert backward_work(remat, *args) == backward_work(loss, *args)


def test_options_drop_the_weights_or_the_outputs():
  loss = _mlp("fp8_current")
  args = _inputs("fp8_current")
  without_remat = backward_work(loss, *args)
  no_weights = jax.checkpoint(loss, policy=jq.remat_policy(weights=False))
  kept = saved_residuals(no_weights, *args)
  assert not [r for r in kept if r.name and r.name.startswith("jaxquant.weight")]
  # Each weight's cast runs in the backward pass, no GEMM.
  work = backward_work(no_weights, *args)
  assert work["gemms"] == without_remat["gemms"] and work["casts"] > without_remat["casts"]
  no_outputs = jax.checkpoint(loss, policy=jq.remat_policy(outputs=False))
  assert not [r for r in saved_residuals(no_outputs, *args) if r.name == "jaxquant.output"]
  # Both forwards again (the backward reads both outputs), their input casts included.
  work = backward_work(no_outputs, *args)
  assert work["gemms"] == without_remat["gemms"] + 2
  assert work["casts"] > without_remat["casts"]


def test_also_adds_a_policy_and_must_be_one():
  loss = _mlp("fp8_current")
  args = _inputs("fp8_current")

  def with_a_named_value(params, x, state):  # sin's backward reads the model's named value
    return loss(params, jnp.sin(checkpoint_name(x * 2, "model.doubled")), state)

  for also, kept in (
    (None, False),
    (jax.checkpoint_policies.save_only_these_names("model.doubled"), True),
  ):
    remat = jax.checkpoint(with_a_named_value, policy=jq.remat_policy(also=also))
    names = {r.name for r in saved_residuals(remat, *args)}
    assert ("model.doubled" in names) == kept and "jaxquant.input_codes" in names
  with pytest.raises(TypeError, match="also must be a jax.checkpoint policy"):
    jq.remat_policy(also="dots")


def test_checkpoint_names_are_the_documented_scheme():
  assert jq.CHECKPOINT_NAMES == (
    "jaxquant.input_codes",
    "jaxquant.input_scales",
    "jaxquant.input_values",
    "jaxquant.weight_codes",
    "jaxquant.weight_scales",
    "jaxquant.weight_values",
    "jaxquant.output",
  )


def _assert_same_gradients(loss, remat, *args):
  """The gradients of `loss` and of its rematerialized form, in one program."""
  grad = lambda f: jax.grad(f, argnums=tuple(range(len(args))))
  want, got = jax.jit(lambda *a: (grad(loss)(*a), grad(remat)(*a)))(*args)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("backward", ["high_precision", "dequantized"])
def test_other_backward_modes_name_what_they_keep(backward):
  """high_precision keeps x itself (values); dequantized its rowwise codes."""
  q = {"input": jq.Float8Quantizer(), "weight": jq.Float8Quantizer()}
  ks = jax.random.split(jax.random.key(1), 2)
  x, kernel = jax.random.normal(ks[0], (M, K), jnp.bfloat16), jax.random.normal(ks[1], (K, F))

  def loss(x, kernel):
    return jnp.sum(jq.dense(x, kernel, quantizers=q, backward=backward).astype(jnp.float32))

  remat = jax.checkpoint(loss, policy=jq.remat_policy())
  kept = {(r.name, r.dtype) for r in saved_residuals(remat, x, kernel) if r.name}
  if backward == "high_precision":
    assert ("jaxquant.input_values", "bf16") in kept and ("jaxquant.weight_values", "f32") in kept
  else:
    assert ("jaxquant.input_codes", "f8_e4m3fn") in kept
    assert ("jaxquant.weight_codes", "f8_e4m3fn") in kept
  _assert_same_gradients(loss, remat, x, kernel)


def test_grouped_dense_keeps_its_input_codes_and_recomputes_no_cast():
  groups, rows = 2, 128
  ks = jax.random.split(jax.random.key(2), 2)
  x = jax.random.normal(ks[0], (rows, K), jnp.bfloat16)
  kernel = jax.random.normal(ks[1], (groups, K, F)) / 8
  sizes = jnp.array([48, 80], jnp.int32)

  def loss(x, kernel):
    y = jq.grouped_dense(x, kernel, sizes, recipe="fp8_current")
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  remat = jax.checkpoint(loss, policy=jq.remat_policy())
  kept = saved_residuals(remat, x, kernel)
  codes = [r for r in kept if r.name == "jaxquant.input_codes"]
  assert [r.dtype for r in codes] == ["f8_e4m3fn"]
  assert any(r.name == "jaxquant.input_scales" for r in kept)
  assert not [
    r for r in kept if not r.argument and r.dtype == "bf16" and r.name != "jaxquant.output"
  ]
  assert backward_work(remat, x, kernel) == backward_work(loss, x, kernel)
  _assert_same_gradients(loss, remat, x, kernel)

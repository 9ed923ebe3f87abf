"""Fast accumulation: which GEMMs a recipe (or a dense call) allows it, how that reaches the
per-tensor FP8 kernel's call, and that the reference's numbers do not depend on it.

The kernel calls are read from programs lowered for CUDA on this machine (the library's
load is stood in for); the kernel's own accuracy in each mode is tested on the GPU
(tests/kernels/test_tensor_gemm.py)."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
import jaxquant.flax as jqf
from jaxquant import kernels, recipes
from jaxquant.ops import _gemm as gemm_ops

M, K, N = 256, 512, 384
E4M3, E5M2 = "f8E4M3FN", "f8E5M2"
# Each GEMM of dense's custom_vjp by its operands' stored shapes and element types
# (numerics.md: fprop x row . w row, dgrad dy row . w col, wgrad x col . dy col).
GEMM_OPERANDS = {
  "fprop": f"tensor<{M}x{K}x{E4M3}>, tensor<{N}x{K}x{E4M3}>",
  "dgrad": f"tensor<{M}x{N}x{E5M2}>, tensor<{K}x{N}x{E4M3}>",
  "wgrad": f"tensor<{K}x{M}x{E4M3}>, tensor<{N}x{M}x{E5M2}>",
}


def test_recipe_normalizes_and_validates_the_gemm_names():
  recipe = recipes.CustomRecipe(recipes.fp8_current_factory, fast_accumulation=["wgrad", "fprop"])
  assert recipe.fast_accumulation == frozenset({"fprop", "wgrad"})
  assert recipes.CustomRecipe(recipes.fp8_current_factory).fast_accumulation == frozenset()
  with pytest.raises(
    ValueError,
    match=r"unknown GEMMs \['bprop'\]; the GEMMs are "
    r"\('fprop', 'dgrad', 'wgrad'\)",
  ):
    recipes.CustomRecipe(recipes.fp8_current_factory, fast_accumulation=("fprop", "bprop"))
  with pytest.raises(TypeError, match=r"got the string 'fprop'; write \('fprop',\)"):
    recipes.CustomRecipe(recipes.fp8_current_factory, fast_accumulation="fprop")
  x, kernel = jnp.ones((M, K), jnp.bfloat16), jnp.ones((K, N), jnp.float32)
  with pytest.raises(ValueError, match="dense 'proj': fast_accumulation names unknown GEMMs"):
    jq.dense(x, kernel, recipe=recipes.fp8_current, name="proj", fast_accumulation=("dx",))


def test_presets_accumulate_the_forward_gemm_fast():
  """The per-tensor FP8 presets as TransformerEngine's: fprop fast, dgrad and wgrad promoted."""
  for name, recipe in recipes.PRESETS.items():
    want = {"fprop"} if name in ("fp8_current", "fp8_delayed") else set()
    assert recipe.fast_accumulation == want, name


def _kernel_calls(monkeypatch, loss, *args):
  """{GEMM: its fast_accumulation attribute} of `loss`'s value and gradient lowered for CUDA
  (the caller stands the library in: `cuda_library_stand_in`)."""
  monkeypatch.setattr(kernels, "available", lambda: True)
  select = gemm_ops.select
  monkeypatch.setattr(
    gemm_ops, "select", lambda problem, _, backend: select(problem, "gpu", backend)
  )
  grad = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
  text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "@jaxquant_fp8_tensor_gemm(" in line]
  found = {}
  for gemm, operands in GEMM_OPERANDS.items():
    matching = [line for line in calls if f"({operands}, tensor<f32>, tensor<f32>)" in line]
    assert len(matching) == 1, (gemm, calls)
    found[gemm] = re.search(r"fast_accumulation = (true|false)", matching[0]).group(1) == "true"
  assert len(calls) == 3, calls
  return found


def _operands():
  x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
  kernel = jax.random.normal(jax.random.key(1), (K, N), jnp.float32)
  return x, kernel


@pytest.mark.parametrize(
  "gemms",
  [(), ("fprop",), ("dgrad",), ("fprop", "wgrad"), recipes.GEMMS],
  ids=lambda g: "+".join(g) or "none",
)
def test_each_gemm_asks_the_kernel_for_what_the_recipe_allows(
  monkeypatch, cuda_library_stand_in, gemms
):
  recipe = dataclasses.replace(recipes.fp8_current, fast_accumulation=gemms)
  loss = lambda x, kernel: jq.dense(x, kernel, recipe=recipe).astype(jnp.float32).sum()
  assert _kernel_calls(monkeypatch, loss, *_operands()) == {g: g in gemms for g in recipes.GEMMS}


def test_dense_argument_overrides_the_recipe(monkeypatch, cuda_library_stand_in):
  loss = lambda x, kernel: (
    jq.dense(x, kernel, recipe=recipes.fp8_current, fast_accumulation=("dgrad",))
    .astype(jnp.float32)
    .sum()
  )
  assert _kernel_calls(monkeypatch, loss, *_operands()) == {
    "fprop": False,
    "dgrad": True,
    "wgrad": False,
  }


def test_swapped_in_flax_layer_takes_the_recipe_s_choice(monkeypatch, cuda_library_stand_in):
  model = jqf.quantize_model(nn.Dense(N, use_bias=False, dtype=jnp.bfloat16), recipes.fp8_current)
  x, _ = _operands()
  params = model.init(jax.random.key(2), x)["params"]
  loss = lambda params, x: model.apply({"params": params}, x).astype(jnp.float32).sum()
  assert _kernel_calls(monkeypatch, loss, params, x) == {
    "fprop": True,
    "dgrad": False,
    "wgrad": False,
  }


def test_reference_sums_do_not_depend_on_it():
  """Without the kernels (on the CPU) every GEMM sums exactly: the same bits either way."""
  x, kernel = jax.device_put(_operands(), jax.devices("cpu")[0])

  def value_and_grads(gemms):
    recipe = dataclasses.replace(recipes.fp8_current, fast_accumulation=gemms)
    f = lambda x, kernel: jq.dense(x, kernel, recipe=recipe).astype(jnp.float32).sum()
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, kernel)

  for got, want in zip(
    jax.tree.leaves(value_and_grads(recipes.GEMMS)),
    jax.tree.leaves(value_and_grads(())),
    strict=False,
  ):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

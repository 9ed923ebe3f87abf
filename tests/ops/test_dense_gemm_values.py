"""A linear layer whose GEMMs all dequantize MXFP8 or NVFP4 (or hybrids of the two) first
takes its operands as bf16 values (operands.takes_gemm_values, asking ops.gemm's
operand_form; kernels/_gemm_values.py): when it does, that the program casts to values and
dequantizes nothing, and that the numbers are those of the
codes-and-scales path.

Without a GPU the choice is stood in for (the kernels' availability, the GPU's GEMM routes);
the kernels' CPU lowerings are the reference, so both paths run here. On a GPU the layer is
compared with the codes path through the kernels (-m gpu)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import kernels, recipes
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.ops import _operands as operands
from jaxquant.quantizers import HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer

M, K, N = 128, 256, 192
on_gpu = pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")


@pytest.fixture
def gpu_routes(monkeypatch, cuda_library_stand_in):
  """The kernels' availability and the GPU's GEMM routes, on this machine."""
  monkeypatch.setattr(kernels, "available", lambda: True)
  select = gemm_ops.select
  monkeypatch.setattr(
    gemm_ops, "select", lambda problem, _, backend: select(problem, "gpu", backend)
  )


def _mxfp8(**kw):
  return dict(
    input=MXFP8Quantizer(**kw), weight=MXFP8Quantizer(**kw), grad_output=MXFP8Quantizer(**kw)
  )


def _nvfp4():
  """The nvfp4 recipe's roles: RHT on the wgrad operands, 16x16 weight tiles, SR on dy."""
  return dict(
    input=NVFP4Quantizer(rht=True),
    weight=NVFP4Quantizer(tile_2d=True),
    grad_output=NVFP4Quantizer(rht=True, stochastic_rounding=True),
  )


def test_every_mxfp8_or_nvfp4_usage_on_large_gemms_takes_values(gpu_routes):
  assert operands.takes_gemm_values(_mxfp8(), "quantized", M, K, N)
  assert operands.takes_gemm_values(_mxfp8(element="e5m2"), "quantized", M, K, N)
  assert operands.takes_gemm_values(_nvfp4(), "quantized", M, K, N)
  plain_nvfp4 = dict(input=NVFP4Quantizer(), weight=NVFP4Quantizer(), grad_output=NVFP4Quantizer())
  assert operands.takes_gemm_values(plain_nvfp4, "quantized", M, K, N)
  hybrid = dict(_mxfp8(), grad_output=HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()))
  assert operands.takes_gemm_values(hybrid, "quantized", M, K, N)
  assert operands.takes_gemm_values(dict(_mxfp8(), weight=NVFP4Quantizer()), "quantized", M, K, N)
  high_precision_usage = dict(_mxfp8(), grad_output=HybridQuantizer(MXFP8Quantizer(), None))
  per_token = dict(_nvfp4(), input=NVFP4Quantizer(per_token=True))
  for quantizers, backward, dims, why in (
    (high_precision_usage, "quantized", (M, K, N), "a hybrid with a high-precision usage"),
    (per_token, "quantized", (M, K, N), "per-token NVFP4 (row scales the values kernel leaves)"),
    (hybrid, "quantized", (M, K, 48), "an MXFP8 usage with a dim of 48 (not whole 32-blocks)"),
    (
      _nvfp4(),
      "quantized",
      (M, K, 32),
      "NVFP4, 32 outputs: fprop takes the fused-dequantize kernel",
    ),
    (dict(_mxfp8(), weight=None), "quantized", (M, K, N), "a high-precision role"),
    (_mxfp8(), "high_precision", (M, K, N), "no quantized backward"),
    (_mxfp8(), "quantized", (32, K, N), "32 tokens: fprop takes the fused-dequantize kernel"),
    (_mxfp8(), "quantized", (M, K, 32), "32 outputs: fprop takes the fused-dequantize kernel"),
  ):
    assert not operands.takes_gemm_values(quantizers, backward, *dims), why


def test_not_without_the_kernels(monkeypatch):
  monkeypatch.setattr(kernels, "available", lambda: False)
  assert not operands.takes_gemm_values(_mxfp8(), "quantized", M, K, N)


def _loss(x, kernel, recipe=recipes.mxfp8):
  return jq.dense(x, kernel, recipe=recipe, key=jax.random.key(7)).astype(jnp.float32).sum()


RECIPES = {"mxfp8": recipes.mxfp8, "nvfp4": recipes.nvfp4, "hybrid": recipes.hybrid}
# The values casts of each recipe's layer: x, the kernel and dy once each, per family (the
# hybrid: the MXFP8 rowwise usages and the NVFP4 columnwise ones, one cast each).
VALUES_CASTS = {"mxfp8": {"mxfp8": 3}, "nvfp4": {"nvfp4": 3}, "hybrid": {"mxfp8": 3, "nvfp4": 3}}


def _assert_casts_to_values(text: str, name: str) -> None:
  for family in ("mxfp8", "nvfp4"):
    assert text.count(f"@jaxquant_{family}_values(") == VALUES_CASTS[name].get(family, 0), text
    assert f"@jaxquant_{family}_cast(" not in text, text
  assert "@jaxquant_dequantize(" not in text, text


def _operands(device=None):
  x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
  kernel = jax.random.normal(jax.random.key(1), (K, N), jnp.float32)
  return jax.device_put((x, kernel), device)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_program_casts_to_values_and_dequantizes_nothing(gpu_routes, name):
  loss = lambda x, kernel: _loss(x, kernel, RECIPES[name])
  text = (
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    .trace(*_operands())
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  _assert_casts_to_values(text, name)


def _value_and_grads(monkeypatch, values: bool, name: str, device=None):
  """The layer's value and gradients (on `device`: the kernels' lowerings for its
  platform), and its jaxpr, on the values path or forced off it."""
  dense_module = importlib.import_module("jaxquant.ops._dense")  # ops.dense is the function
  with monkeypatch.context() as patch:
    if not values:
      patch.setattr(dense_module, "takes_gemm_values", lambda *args: False)
    f = jax.value_and_grad(lambda x, kernel: _loss(x, kernel, RECIPES[name]), argnums=(0, 1))
    return jax.jit(f)(*_operands(device)), str(jax.make_jaxpr(f)(*_operands(device)))


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.slow
def test_values_path_gives_the_codes_path_bits(gpu_routes, monkeypatch, name):
  """Both paths on the kernels' CPU lowerings: the same bf16 GEMM inputs (NVFP4: the same
  random bits, the same S_dec), the same sums."""
  cpu = jax.devices("cpu")[0]
  (got, got_jaxpr), (want, want_jaxpr) = (
    _value_and_grads(monkeypatch, v, name, cpu) for v in (True, False)
  )
  for family in VALUES_CASTS[name]:
    target = f"jaxquant_{family}_values"
    assert target in got_jaxpr and target not in want_jaxpr
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_values_path_on_the_gpu(monkeypatch, name):
  """Through the kernels: the values path's program has no dequantize call, and its value
  and gradients are the codes path's within bf16 GEMMs' summation order."""
  loss = lambda x, kernel: _loss(x, kernel, RECIPES[name])
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*_operands()).as_text()
  _assert_casts_to_values(text, name)
  (got, _), (want, want_jaxpr) = (_value_and_grads(monkeypatch, v, name) for v in (True, False))
  assert all(f"jaxquant_{family}_values" not in want_jaxpr for family in VALUES_CASTS[name])
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w)

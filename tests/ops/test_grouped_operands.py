"""grouped_dense's operands: per-tensor FP8 cast per group from the input's own dtype, bit
for bit the reference's (reference.grouped on an fp32 copy), and what the GPU program of a
quantized grouped layer holds (lowered for CUDA here: the library is stood in for)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant import kernels, recipes
from jaxquant.ops import _grouped_operands as operands
from jaxquant.ops._grouped_dense import init_grouped_state
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer, HybridQuantizer
from jaxquant.reference import _fp32 as fp32
from jaxquant.reference import _grouped as ref

SIZES = np.array([0, 1, 37, 0, 90, 16], np.int32)
ROWS, COLS = 160, 48  # 16 rows past the groups


def _activations(dtype, seed=0):
  """Groups of very different ranges, NUMERICS.md's edge values in group 4, and inf/NaN in
  the rows of no group (which must neither raise an amax nor reach a group's codes)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
  x *= np.repeat(np.exp2(np.arange(len(SIZES) + 1) * 3.0 - 6), np.append(SIZES, 16))[:, None]
  edge = [0.0, -0.0, np.nan, 1e-40, -1e-45, 2.0**-126, 65504.0, 3e38]
  x[40, : len(edge)] = edge
  x[-16:, :4] = [np.inf, -np.inf, np.nan, 1e30]
  with np.errstate(over="ignore"):  # float16: the largest values become inf
    return jnp.asarray(x.astype(dtype))


def _reference(x, layout, q, usage, delayed_scale=None):
  x32 = jnp.where(layout.row_mask()[:, None], fp32.widen(x), 0.0)
  return ref.quantize_rows(
    x32, layout, q, usage, input_dtype=x.dtype, what="x", delayed_scale=delayed_scale
  )


QUANTIZERS = {
  "e4m3": Float8Quantizer(),
  "e5m2": Float8Quantizer("e5m2"),
  "pow2_eps": Float8Quantizer(eps=1e-3, pow2_scales=True),
  "hybrid": HybridQuantizer(Float8Quantizer(), Float8Quantizer("e5m2")),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_fp8_codes_are_the_references(name, usage, dtype):
  x = _activations(dtype)
  layout = ref.group_layout(jnp.asarray(SIZES), ROWS)
  q = QUANTIZERS[name]
  got, amax = jax.jit(lambda x: operands.quantize_rows(x, layout, q, usage, what="x"))(x)
  want, _ = _reference(x, layout, q, usage)
  assert amax is None and got.row_scale is None
  assert got.values.dtype == got.exact and jnp.dtype(got.exact).itemsize == 1
  mask = np.asarray(layout.row_mask())
  values = np.asarray(got.values.astype(jnp.float32))[mask]
  np.testing.assert_array_equal(
    values.view(np.uint32), np.asarray(want.values)[mask].view(np.uint32)
  )
  outer = np.asarray(want.outer)
  want_groups = outer if usage == "columnwise" else outer[np.cumsum(SIZES) - 1][SIZES > 0]
  got_groups = (
    np.asarray(got.group_scale) if usage == "columnwise" else np.asarray(got.group_scale)[SIZES > 0]
  )
  np.testing.assert_array_equal(got_groups.view(np.uint32), want_groups.view(np.uint32))


def test_delayed_scale_and_recorded_amax_are_the_references():
  x = _activations(jnp.bfloat16, seed=1)
  layout = ref.group_layout(jnp.asarray(SIZES), ROWS)
  q = DelayedFloat8Quantizer()
  # Any float is a delayed scale: tiny, huge (products overflow: saturate), and ordinary.
  scale = jnp.asarray([1.0, 2.0**-10, 3e3, 7.0, 1e30, 0.5], jnp.float32)
  got, amax = operands.quantize_rows(x, layout, q, "rowwise", what="x", delayed_scale=scale)
  want, want_amax = _reference(x, layout, q, "rowwise", delayed_scale=scale)
  mask = np.asarray(layout.row_mask())
  np.testing.assert_array_equal(
    np.asarray(got.values.astype(jnp.float32))[mask].view(np.uint32),
    np.asarray(want.values)[mask].view(np.uint32),
  )
  np.testing.assert_array_equal(
    np.asarray(amax).view(np.uint32), np.asarray(want_amax).view(np.uint32)
  )


@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_expert_codes_are_the_references(usage):
  rng = np.random.default_rng(2)
  kernel = (
    rng.standard_normal((5, 48, 32)).astype(np.float32) * np.exp2(np.arange(5) - 2)[:, None, None]
  )
  kernel[2] = 0.0  # an all-zero expert: scale 1
  kernel[3, 0, :3] = [np.nan, 1e-40, -3e38]
  kernel = jnp.asarray(kernel, jnp.bfloat16)
  q = Float8Quantizer()
  got, _ = jax.jit(lambda k: operands.quantize_experts(k, q, usage))(kernel)
  values, outer, _ = jax.jit(
    lambda k: ref.quantize_experts(jnp.swapaxes(fp32.widen(k), 1, 2), q, usage)
  )(kernel)
  np.testing.assert_array_equal(
    np.asarray(got.values.astype(jnp.float32)).view(np.uint32), np.asarray(values).view(np.uint32)
  )
  np.testing.assert_array_equal(np.asarray(got.group_scale), np.asarray(outer))


# ---- The GPU program ----

M, K, N, G = 512, 256, 384, 8


def _gpu_program(monkeypatch, recipe, state=None):
  monkeypatch.setattr(kernels, "available", lambda: True)
  sizes = jnp.asarray([100, 0, 60, 96, 1, 200, 40, 15], jnp.int32)

  def loss(x, kernel, state):
    out = jq.grouped_dense(x, kernel, sizes, recipe=recipe, state=state)
    y = out if state is None else out[0]
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  x = jnp.ones((M, K), jnp.bfloat16)
  kernel = jnp.ones((G, K, N), jnp.float32)  # fp32 params, as Flax models keep them
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2) if state else (0, 1))
  return jax.jit(grad).trace(x, kernel, state).lower(lowering_platforms=("cuda",)).as_text()


def _f32_dots(text):
  return [
    line
    for line in text.splitlines()
    if "dot_general" in line and re.search(r"\(tensor<[0-9x]*xf32>, tensor<[0-9x]*xf32>\)", line)
  ]


@pytest.mark.parametrize("name", ["bf16", "fp8_current", "fp8_delayed"])
def test_gpu_program_runs_every_gemm_on_the_grouped_kernels(
  monkeypatch, cuda_library_stand_in, name
):
  """fprop, dgrad and wgrad on the grouped kernels, in FP8 for the FP8 recipes: no fp32
  dot_general and no loop (the reference's scanned products) in the program."""
  recipe = recipes.get(name)
  state = None
  if name == "fp8_delayed":
    state = init_grouped_state(recipe.quantizers("grouped_linear", ""), G)
  text = _gpu_program(monkeypatch, recipe, state)
  assert not _f32_dots(text), _f32_dots(text)[:3]
  assert "stablehlo.while" not in text
  element = {"bf16": "bf16", "fp8_current": "f8E4M3FN", "fp8_delayed": "f8E4M3FN"}[name]
  grad_element = {"bf16": "bf16"}.get(name, "f8E5M2")
  gemm = [line for line in text.splitlines() if "@jaxquant_grouped_gemm(" in line]
  wgrad = [line for line in text.splitlines() if "@jaxquant_grouped_wgrad(" in line]
  assert len(gemm) == 2 and len(wgrad) == 1, (gemm, wgrad)
  fprop, dgrad = sorted(gemm, key=lambda line: f"tensor<{M}x{K}x" not in line)
  assert f"(tensor<{M}x{K}x{element}>, tensor<{G}x{N}x{K}x{element}>" in fprop
  assert f"(tensor<{M}x{N}x{grad_element}>, tensor<{G}x{K}x{N}x{element}>" in dgrad
  columns = kernels._grouped.aligned_columns(M, G)
  assert f"(tensor<{K}x{columns}x{element}>, tensor<{N}x{columns}x{grad_element}>" in wgrad[0]

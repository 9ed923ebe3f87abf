"""The swap-in of a model whose MoE experts are `jax.lax.ragged_dot` (gemma 4's style): a
[G, K, N] expert param contracted with tokens sorted by expert is a "grouped_linear" role
run by `ops.grouped_dense`, bit for bit; bf16 is the plain model."""

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant.flax as jqf
from jaxquant import ops, recipes
from jaxquant.intercept import _calls as calls
from jaxquant.intercept import _session as sessions
from jaxquant.intercept._calls import Call

TOKENS, D, F, EXPERTS, TOP_K = 16, 64, 128, 4, 2


def ragged_dot(lhs, rhs, group_sizes, **kwargs):
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, **kwargs)


def ragged_dot_general(lhs, rhs, group_sizes, **kwargs):
  numbers = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
  )
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, **kwargs)


class MoEBlock(nn.Module):
  """Router (high precision), top-k, tokens sorted by expert, `expert_gemm` per expert."""

  expert_gemm: Callable = ragged_dot
  features: int = F
  gemm_kwargs: Optional[dict] = None
  group_offset: Optional[int] = None

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    init = nn.initializers.normal(0.05)
    router = self.param("router", init, (d, EXPERTS))
    wi = self.param("wi", init, (EXPERTS, d, self.features))
    wo = self.param("wo", init, (EXPERTS, self.features, d))
    logits = jnp.dot(x, router, precision=jax.lax.Precision.HIGHEST)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.repeat(x, TOP_K, axis=0)[order]
    group_sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    kwargs = dict(self.gemm_kwargs or {})
    if self.group_offset is not None:
      kwargs["group_offset"] = jnp.array([self.group_offset], jnp.int32)
    h = jax.nn.gelu(self.expert_gemm(rows, wi, group_sizes, **kwargs))
    y = self.expert_gemm(h, wo, group_sizes, **kwargs)
    y = jnp.zeros_like(y).at[order].set(y)
    return (y.reshape(x.shape[0], TOP_K, -1) * weights[..., None].astype(y.dtype)).sum(1)


class Model(nn.Module):
  block: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.block(x)


EXPERTS_QUANTIZED = recipes.CustomRecipe(
  lambda role: None if role.module_type == "linear" else recipes.fp8_current_factory(role),
  name="experts_fp8",
)


def grouped_dense_gemm(lhs, rhs, group_sizes, preferred_element_type=None):
  dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  return ops.grouped_dense(
    lhs.astype(dtype), rhs.astype(dtype), group_sizes, recipe=EXPERTS_QUANTIZED
  )


def inputs(dtype=jnp.float32):
  return jax.random.normal(jax.random.key(1), (TOKENS, D), dtype)


def setup(block):
  x = inputs()
  params = Model(block).init(jax.random.key(0), x)
  return params, x


def loss_and_grads(model, params, x, jit):
  def loss(p):
    return jnp.sum(model.apply(p, x) ** 2)

  fn = jax.value_and_grad(loss)
  return (jax.jit(fn) if jit else fn)(params)


@pytest.mark.slow  # over 20 s: run under the newest JAX only
@pytest.mark.parametrize(
  "gemm, jit",
  [
    (ragged_dot, True),
    (ragged_dot_general, True),
    # Eagerly every op of the quantized GEMMs compiles on its own: slow on CPU.
    pytest.param(ragged_dot, False, marks=pytest.mark.slow),
  ],
  ids=["ragged_dot-jit", "ragged_dot_general-jit", "ragged_dot-eager"],
)
def test_experts_are_quantized_as_grouped_dense_bit_for_bit(gemm, jit):
  params, x = setup(MoEBlock(gemm))
  swapped = jqf.quantize_model(Model(MoEBlock(gemm)), EXPERTS_QUANTIZED)
  reference = Model(MoEBlock(grouped_dense_gemm))
  got = loss_and_grads(swapped, params, x, jit)
  expected = loss_and_grads(reference, params, x, jit)
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  # ... and they are FP8's, not the plain model's.
  plain = loss_and_grads(Model(MoEBlock(gemm)), params, x, jit)
  assert not np.array_equal(got[1]["params"]["block"]["wi"], plain[1]["params"]["block"]["wi"])


def test_report_lists_the_expert_gemms_as_grouped_linear_roles():
  params, x = setup(MoEBlock())
  report = jqf.swap_report(jqf.quantize_model(Model(MoEBlock()), EXPERTS_QUANTIZED), params, x)
  assert [(r.role, r.status) for r in report.quantized] == [
    ("block/wi", sessions.QUANTIZED),
    ("block/wo", sessions.QUANTIZED),
  ]
  assert all(r.call == "ragged_dot 'mk,gkn->mn'" for r in report.quantized)
  assert report.quantized[0].shapes == ((TOKENS * TOP_K, D), (EXPERTS, D, F))
  (router,) = [r for r in report.rows if r.role == "block/router"]
  assert router.status == sessions.RECIPE_NONE


def test_roles_are_grouped_linear():
  params, x = setup(MoEBlock())
  seen = []
  recording = recipes.CustomRecipe(lambda role: seen.append(role))
  jqf.quantize_model(Model(MoEBlock()), recording).apply(params, x)
  grouped = {(r.name, r.tensor_type) for r in seen if r.module_type == "grouped_linear"}
  assert grouped == {
    (n, t) for n in ("block/wi", "block/wo") for t in ("input", "weight", "grad_output")
  }


@pytest.mark.parametrize("gemm", [ragged_dot, ragged_dot_general], ids=lambda f: f.__name__)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_bf16_is_the_plain_model_bit_for_bit(gemm, jit):
  params, x = setup(MoEBlock(gemm))
  got = loss_and_grads(jqf.quantize_model(Model(MoEBlock(gemm)), recipes.bf16), params, x, jit)
  jax.tree.map(
    np.testing.assert_array_equal, got, loss_and_grads(Model(MoEBlock(gemm)), params, x, jit)
  )


@pytest.mark.slow  # over 20 s: run under the newest JAX only
def test_preferred_element_type_is_the_output_dtype():
  kwargs = {"preferred_element_type": jnp.float32}
  block = MoEBlock(gemm_kwargs=kwargs)
  x = inputs(jnp.bfloat16)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), Model(block).init(jax.random.key(0), x))
  got = jqf.quantize_model(Model(block), EXPERTS_QUANTIZED).apply(params, x)
  expected = Model(MoEBlock(grouped_dense_gemm, gemm_kwargs=kwargs)).apply(params, x)
  assert got.dtype == Model(block).apply(params, x).dtype == jnp.float32
  np.testing.assert_array_equal(got, expected)


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_an_unfit_expert_runs_as_written_or_raises():
  block = MoEBlock(features=48)  # N = 48: no MXFP8 32-block tiling
  params, x = setup(block)
  with pytest.raises(ValueError, match="block/wi.*on_unfit='high_precision'"):
    jqf.quantize_model(Model(block), recipes.mxfp8).apply(params, x)
  model = jqf.quantize_model(Model(block), recipes.mxfp8, on_unfit="high_precision")
  np.testing.assert_array_equal(model.apply(params, x), Model(block).apply(params, x))
  (wi,) = [r for r in jqf.swap_report(model, params, x).rows if r.role == "block/wi"]
  assert "does not fit dim N (output features) = 48" in wi.status


def test_a_group_offset_runs_as_written_and_is_read_as_no_weight_gemm():
  # JAX 0.10 to 0.12 refuse every group_offset (an array is no hashable equation
  # parameter): under the swap-in the call runs as written, so it fails as plainly.
  block = MoEBlock(group_offset=1)
  x = inputs()
  with pytest.raises(TypeError) as plain:
    Model(block).init(jax.random.key(0), x)
  params = Model(MoEBlock()).init(jax.random.key(0), x)
  with pytest.raises(TypeError) as swapped:
    jqf.quantize_model(Model(block), EXPERTS_QUANTIZED).apply(params, x)
  assert str(swapped.value) == str(plain.value)
  w = params["params"]["block"]["wi"]
  sizes = jnp.array([TOKENS, 0, 0, 0], jnp.int32)
  plain_numbers = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
  for kind, args in (("ragged_dot", ()), ("ragged_dot_general", (plain_numbers,))):
    kwargs = {"group_offset": jnp.array([1], jnp.int32)}
    call = Call(kind, (x, w, sizes, *args), kwargs, getattr(jax.lax, kind))
    assert calls.contraction(call) == "a ragged_dot with a group_offset"


class RaggedContracting(nn.Module):
  """`ragged_dot_general` ragged along the contraction: [M, K] x [K, N] -> [G, M, N]."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (x.shape[1], F))
    numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [0]), ([], [])),
      lhs_ragged_dimensions=[1],
      rhs_group_dimensions=[],
    )
    sizes = jnp.array([D // 2, D // 2], jnp.int32)
    return jax.lax.ragged_dot_general(x, w, sizes, numbers)


def test_other_ragged_dimension_numbers_run_as_written_and_are_reported():
  x = inputs()
  params = RaggedContracting().init(jax.random.key(0), x)
  model = jqf.quantize_model(RaggedContracting(), EXPERTS_QUANTIZED, require_gemm=False)
  np.testing.assert_array_equal(model.apply(params, x), RaggedContracting().apply(params, x))
  (row,) = jqf.swap_report(model, params, x).rows
  assert row.status.startswith(f"{sessions.NOT_A_WEIGHT_GEMM} (a ragged_dot_general with")


class EinsumExperts(nn.Module):
  """Per-expert weights through einsum: a grouped GEMM of equal groups."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.normal(0.05), (EXPERTS, D, 48))
    return jnp.einsum("gmk,gkn->gmn", x, w)


def test_an_unfit_einsum_expert_raises_naming_the_role_before_grouped_dense_does():
  # N = 48 fits the forward's MXFP8 blocks but not the weight's columnwise (backward)
  # usage, which ops.grouped_dense checks even for a forward only.
  x = jax.random.normal(jax.random.key(1), (EXPERTS, 8, D))
  params = EinsumExperts().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="'w'.*dim N .* = 48.*on_unfit='high_precision'"):
    jqf.quantize_model(EinsumExperts(), recipes.mxfp8).apply(params, x)

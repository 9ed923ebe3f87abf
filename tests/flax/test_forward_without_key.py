"""A forward pass (evaluation, generation) runs under every preset without a 'quant' key:
stochastic rounding is the gradients' (nvfp4's grad_output), so the key is asked for only
where a backward pass that rounds is traced, with an error saying how to pass it. Models
as their packages write them: a Linen LM (transformers' Flax style) and an NNX LM whose
head is contracted by its own code (EasyDeL's), each with swapped and routed GEMMs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

VOCAB, D, F, TOKENS = 64, 32, 64, (4, 16)
TOKEN_DATA = jax.random.randint(jax.random.key(3), TOKENS, 0, VOCAB)
PRESETS = sorted(recipes.PRESETS)


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D, name="wte")(tokens).astype(jnp.bfloat16)
    x = x + nn.Dense(D, dtype=jnp.bfloat16, name="c_proj")(
      nn.gelu(nn.Dense(F, dtype=jnp.bfloat16, name="c_fc")(x))
    )
    head = self.param("lm_head", nn.initializers.normal(0.05), (D, VOCAB))
    return x @ head.astype(jnp.bfloat16)


class ParallelLinear(nnx.Module):
  def __init__(self, d_in, d_out, *, rngs):
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out)))

  def __call__(self, x):
    return jax.lax.dot_general(
      x, self.kernel[...].astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ()))
    )


class NnxLM(nnx.Module):
  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.up = nnx.Linear(D, F, dtype=jnp.bfloat16, rngs=rngs)
    self.down = nnx.Linear(F, D, dtype=jnp.bfloat16, rngs=rngs)
    self.lm_head = ParallelLinear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    return self.lm_head(x + self.down(nnx.gelu(self.up(x))))


@pytest.fixture(scope="module")
def linen_variables():
  return jax.jit(jqf.quantize_model(LinenLM(), recipes.fp8_delayed).init)(
    jax.random.key(0), TOKEN_DATA
  )


@pytest.mark.parametrize("preset", PRESETS)
def test_linen_forward_runs_without_a_key(linen_variables, preset):
  model = jqf.quantize_model(LinenLM(), preset)
  variables = linen_variables if preset == "fp8_delayed" else {"params": linen_variables["params"]}
  with jqf.linen.frozen_quant_state():  # evaluation: the stored scales, nothing written
    logits = jax.jit(model.apply)(variables, TOKEN_DATA)
  assert logits.shape == (*TOKENS, VOCAB) and np.all(np.isfinite(logits))
  report = jqf.swap_report(model, variables, TOKEN_DATA)
  assert len(report.quantized) == (0 if preset == "bf16" else 3)


@pytest.mark.parametrize("preset", PRESETS)
def test_nnx_forward_runs_without_a_key(preset):
  model = jqf.quantize_model(NnxLM(rngs=nnx.Rngs(0)), preset)  # no rngs=
  logits = nnx.jit(lambda model: model(TOKEN_DATA))(model)
  assert logits.shape == (*TOKENS, VOCAB) and np.all(np.isfinite(logits))


def test_a_backward_that_rounds_asks_for_the_key():
  model = jqf.quantize_model(LinenLM(), recipes.nvfp4)
  variables = {"params": jax.jit(model.init)(jax.random.key(0), TOKEN_DATA)["params"]}
  loss = lambda variables, **kw: jnp.mean(model.apply(variables, TOKEN_DATA, **kw) ** 2)
  with pytest.raises(ValueError, match=r"grad_output: .* rounds stochastically in the backward"):
    jax.jit(jax.grad(loss))(variables)
  grads = jax.jit(jax.grad(lambda v: loss(v, rngs={"quant": jax.random.key(1)})))(variables)
  assert np.all(np.isfinite(grads["params"]["lm_head"]))

  nnx_model = jqf.quantize_model(NnxLM(rngs=nnx.Rngs(0)), recipes.nvfp4)
  nnx_loss = lambda model: jnp.mean(model(TOKEN_DATA).astype(jnp.float32) ** 2)
  with pytest.raises(ValueError, match="rngs=nnx.Rngs"):
    nnx.grad(nnx_loss)(nnx_model)


class RaggedExperts(nn.Module):
  """gemma 4's MoE experts: tokens sorted by expert, `jax.lax.ragged_dot` per expert."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D, name="embed")(tokens).reshape(-1, D).astype(jnp.bfloat16)
    experts = self.param("experts", nn.initializers.normal(0.05), (4, D, F))
    order = jnp.argsort(tokens.reshape(-1) % 4, stable=True)
    sizes = jnp.bincount(tokens.reshape(-1) % 4, length=4).astype(jnp.int32)
    return jax.lax.ragged_dot(x[order], experts.astype(jnp.bfloat16), sizes)


class NnxGroupedLM(nnx.Module):
  """jaxquant's own NnxGroupedDense in an NNX model."""

  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.experts = jqf.NnxGroupedDense(D, F, 4, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens).reshape(-1, D).astype(jnp.bfloat16)
    return self.experts(x, jnp.full((4,), x.shape[0] // 4, jnp.int32))


def test_grouped_gemms_run_forward_without_a_key_with_the_keyed_bits():
  model = jqf.quantize_model(RaggedExperts(), recipes.nvfp4)
  variables = {"params": jax.jit(model.init)(jax.random.key(0), TOKEN_DATA)["params"]}
  apply = jax.jit(model.apply)
  keyed = apply(variables, TOKEN_DATA, rngs={"quant": jax.random.key(1)})
  np.testing.assert_array_equal(apply(variables, TOKEN_DATA), keyed)
  loss = lambda variables: jnp.mean(model.apply(variables, TOKEN_DATA).astype(jnp.float32) ** 2)
  with pytest.raises(ValueError, match=r"'experts' grad_output: .* in the backward pass"):
    jax.jit(jax.grad(loss))(variables)

  nnx_model = jqf.quantize_model(NnxGroupedLM(rngs=nnx.Rngs(0)), recipes.nvfp4)
  forward = nnx.jit(lambda model: model(TOKEN_DATA))
  unkeyed = forward(nnx_model)
  keyed = forward(jqf.quantize_model(nnx_model, recipes.nvfp4, rngs=nnx.Rngs(quant=1)))
  np.testing.assert_array_equal(unkeyed, keyed)


def test_nnx_hooks_run_forward_without_a_key_and_ask_for_one_in_the_backward():
  """`nnx.Linear(dot_general=...)` and `nnx.Einsum(einsum_op=...)` (a batched einsum over
  experts: a grouped GEMM) under nvfp4: the forward rounds nothing stochastically, so it
  runs and gives the bits of jaxquant's own layer, which holds a key; a gradient asks."""
  x = jax.random.normal(jax.random.key(4), (2, 16, D), jnp.bfloat16)
  hooked = nnx.Linear(
    D, D, use_bias=False, rngs=nnx.Rngs(0), dot_general=jqf.dot_general("proj", "nvfp4")
  )
  native = jqf.nnx.Linear(
    D, D, use_bias=False, rngs=nnx.Rngs(0), recipe="nvfp4", name="proj", quant_rngs=nnx.Rngs(1)
  )
  forward = nnx.jit(lambda layer, x: layer(x))
  np.testing.assert_array_equal(forward(hooked, x), forward(native, x))
  experts = nnx.Einsum(
    "ecd,edf->ecf", (2, D, F), rngs=nnx.Rngs(0), einsum_op=jqf.einsum_op("experts", "nvfp4")
  )
  assert forward(experts, x).shape == (2, 16, F)
  loss = lambda layer, x: jnp.mean(layer(x).astype(jnp.float32) ** 2)
  for layer in (hooked, experts):
    with pytest.raises(ValueError, match=r"grad_output: .* rounds stochastically in the backward"):
      nnx.grad(loss)(layer, x)

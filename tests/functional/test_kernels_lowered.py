"""The plain-JAX GPT's fp8_current train step runs jaxquant's CUDA kernels: lowered for
CUDA on any machine (the library's load stood in for), and compiled and run on the GPU
beside the Flax swap-in's step of the same model."""

import collections
import re
import time

import jax
import numpy as np
import optax
import pytest
from function_models import FlaxGpt, gpt, gpt_batch, gpt_loss, gpt_params

import jaxquant
import jaxquant.flax as jqf
from jaxquant import kernels
from jaxquant.ops import _gemm as gemm_ops

WEIGHT_GEMMS = 5  # w_qkv, w_o, w_in, w_out (the scanned layer's body), head


def train_step(loss_fn):
  tx = optax.adam(1e-3)

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step), tx


def function_loss(params, tokens):
  return gpt_loss(jaxquant.quantize(gpt, "fp8_current")(params, tokens), tokens)


def flax_loss(params, tokens):
  model = jqf.quantize_model(FlaxGpt(), "fp8_current")
  return gpt_loss(model.apply({"params": params}, tokens), tokens)


def kernel_calls(text: str) -> collections.Counter:
  """The FFI calls of lowered StableHLO (`@target(`) or compiled HLO (`custom_call_target`)."""
  return collections.Counter(re.findall(r'(?:@|custom_call_target=")(jaxquant_\w+)', text))


def test_train_step_lowers_to_the_ffi_kernels(monkeypatch, cuda_library_stand_in):
  monkeypatch.setattr(kernels, "available", lambda: True)
  select = gemm_ops.select
  monkeypatch.setattr(
    gemm_ops, "select", lambda problem, _, backend: select(problem, "gpu", backend)
  )
  params = gpt_params(jax.random.key(0))
  step, tx = train_step(function_loss)
  lowered = step.trace(params, tx.init(params), gpt_batch()).lower(lowering_platforms=("cuda",))
  calls = kernel_calls(lowered.as_text())
  assert calls["jaxquant_fp8_tensor_gemm"] == 3 * WEIGHT_GEMMS  # fprop, dgrad, wgrad each
  assert calls["jaxquant_fp8_tensor_cast"] > 0


def _median_step_s(step, params, opt_state, tokens, repeats=20):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, tokens)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}")
def test_train_step_runs_the_kernels_on_the_gpu_as_the_flax_swap_in_does():
  params, tokens = gpt_params(jax.random.key(0)), gpt_batch()
  results = {}
  for name, loss_fn in (("function", function_loss), ("flax", flax_loss)):
    step, tx = train_step(loss_fn)
    opt_state = tx.init(params)
    compiled = step.lower(params, opt_state, tokens).compile()
    calls = kernel_calls(compiled.as_text())
    assert calls["jaxquant_fp8_tensor_gemm"] >= 3 * WEIGHT_GEMMS, (name, calls)
    _, _, loss = step(params, opt_state, tokens)  # compiles and warms up
    results[name] = (float(loss), _median_step_s(step, params, opt_state, tokens))
  for name, (loss, seconds) in results.items():
    print(f"{name}: loss {loss:.6f}, median step {seconds * 1e3:.3f} ms")
  np.testing.assert_allclose(results["function"][0], results["flax"][0], rtol=1e-5)

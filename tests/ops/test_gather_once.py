"""A per-tensor FP8 weight under `WeightGather` crosses the network once a step, in one
usage (ops/_weight_gather.py), on 8 CPU devices.

- Bytes: the compiled train step of a dense layer all-gathers at most half the bytes of
  plain FSDP in bf16 (XLA's own gather of the bf16 kernel, kept for the backward).
- Bits: the step's loss, gradients and delayed-scaling state are those of the unsharded
  step, and the gathered operands those of quantizing each usage's shards and gathering
  them, with the kernel split over K, over N, and over K x tensor-parallel N.
- The other usage is the gathered one's codes transposed on each device, the same bits
  whether the casts run the reference or the kernel primitives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _sharded_checks import all_gathers, assert_same_bits, mesh_2x2x2
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant import recipes, scaling
from jaxquant.ops._backend import BACKEND_VAR
from jaxquant.ops._operands import quantize_transposed_operand, resolve_quantizers
from jaxquant.ops._weight_gather import (
  WeightGather,
  gather_operand,
  quantize_gathered_once,
  quantize_shards,
)
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer, HybridQuantizer

USAGES = ("rowwise", "columnwise")
KERNEL = (256, 128)  # [K, N]
X_ROWS = 64
SPECS = {"fsdp_k": P("fsdp", None), "fsdp_n": P(None, "fsdp"), "fsdp_x_tensor": P("fsdp", "tensor")}
# The bytes an element of each HLO element type takes.
_BYTES = {"u8": 1, "s8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "u32": 4}


def _train_step(recipe, weight_gather, kernel_spec=None, mesh=None, quantizers=None):
  """jit'd value_and_grad of a dense layer's squared error over (kernel, x, state): (loss,
  new_state) and the gradients. `kernel_spec`: plain FSDP, the kernel constrained to its
  gathered layout (as FSDP does) and left to XLA's partitioner."""

  def loss(kernel, x, target, state):
    if kernel_spec is not None:
      tensor = tuple(a if a != "fsdp" else None for a in kernel_spec)
      kernel = jax.lax.with_sharding_constraint(kernel, NamedSharding(mesh, P(*tensor)))
    out = jq.dense(
      x,
      kernel,
      recipe=recipe,
      quantizers=quantizers,
      name="layer",
      state=state,
      weight_gather=weight_gather,
    )
    y, new_state = out if state is not None else (out, None)
    return jnp.mean(jnp.square(y.astype(jnp.float32) - target)), new_state

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3), has_aux=True))


def _inputs(recipe):
  keys = jax.random.split(jax.random.key(0), 3)
  kernel = jax.random.normal(keys[0], KERNEL, jnp.float32) * 0.05
  x = jax.random.normal(keys[1], (X_ROWS, KERNEL[0]), jnp.float32)
  target = jax.random.normal(keys[2], (X_ROWS, KERNEL[1]), jnp.float32)
  state = None
  if recipe is recipes.fp8_delayed:
    # A recorded history, so the step's scales are not the initial ones.
    amax = lambda v: jnp.zeros((16,), jnp.float32).at[0].set(v)
    state = {
      "input": scaling.DelayedScalingState(amax(3.0), jnp.float32(100.0)),
      "weight": scaling.DelayedScalingState(amax(0.2), jnp.float32(2000.0)),
      "grad_output": scaling.DelayedScalingState(amax(0.05), jnp.float32(5000.0)),
    }
  return kernel, x, target, state


def _placed(mesh, spec, kernel, x, target, state):
  return (
    jax.device_put(kernel, NamedSharding(mesh, spec)),
    jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None))),
    target,
    state,
  )


@pytest.mark.parametrize("spec", ["fsdp_k", "fsdp_x_tensor"])
def test_fp8_gathers_half_of_bf16s_bytes(spec, eight_devices):
  mesh = mesh_2x2x2(eight_devices)
  kernel_spec = SPECS[spec]
  kernel, x, target, _ = _inputs(recipes.fp8_current)
  placed = _placed(mesh, kernel_spec, kernel.astype(jnp.bfloat16), x, target, None)
  bf16 = all_gathers(
    _train_step(recipes.bf16, None, kernel_spec, mesh).lower(*placed).compile().as_text()
  )
  fp8 = all_gathers(
    _train_step(recipes.fp8_current, WeightGather(mesh, kernel_spec))
    .lower(*placed)
    .compile()
    .as_text()
  )
  # bf16 FSDP gathers its kernel's shard of the tensor axis once, nothing else. (XLA:CPU
  # widens a bf16 all-gather to f32, as it would FP8 to f16: 2 bytes an element is what
  # the collective moves on a GPU.)
  tensor_shards = 2 if "tensor" in tuple(kernel_spec) else 1
  kernel_elements = kernel.size // tensor_shards
  assert [n for _, n in bf16] == [kernel_elements], bf16
  bf16_bytes = kernel_elements * 2
  codes = sum(n for t, n in fp8 if _BYTES[t] == 1)
  scales = sum(n * _BYTES[t] for t, n in fp8 if _BYTES[t] > 1)
  assert codes == kernel_elements, f"FP8 codes gathered {codes / bf16_bytes:.2f}x bf16's bytes"
  assert codes <= 0.5 * bf16_bytes
  assert scales == 0, f"per-tensor scales are the same on every shard, not gathered: {fp8}"


QUANTIZERS = {
  "fp8_current": Float8Quantizer("e5m2", eps=1e-3, pow2_scales=True),
  "fp8_delayed": DelayedFloat8Quantizer(),
}


@pytest.mark.parametrize(
  "name, spec",
  [("fp8_current", "fsdp_k"), ("fp8_delayed", "fsdp_n"), ("fp8_current", "fsdp_x_tensor")],
)
@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_one_usage_gathered_the_other_transposed(name, spec, backend, eight_devices, monkeypatch):
  # "kernel": the shard casts bind the cast primitive (its reference lowering here);
  # "reference": the reference cast.
  monkeypatch.setenv(BACKEND_VAR, backend)
  quantizer = QUANTIZERS[name]
  mesh = mesh_2x2x2(eight_devices)
  gather = WeightGather(mesh, SPECS[spec])
  kernel = (jax.random.normal(jax.random.key(1), KERNEL, jnp.float32) * 0.05).astype(jnp.bfloat16)
  state = None
  if isinstance(quantizer, DelayedFloat8Quantizer):  # a scale that clips the largest values
    state = scaling.DelayedScalingState(
      jnp.zeros((4,), jnp.float32).at[0].set(0.01), jnp.float32(3000.0)
    )

  once = jax.jit(lambda k, s: quantize_gathered_once(k, quantizer, USAGES, gather=gather, state=s))

  @jax.jit
  def per_usage(kernel, state):
    shards, new_state = quantize_shards(kernel, quantizer, USAGES, gather=gather, state=state)
    return {u: gather_operand(shards[u], u, gather) for u in USAGES}, new_state

  unsharded = jax.jit(lambda k, s: quantize_transposed_operand(k, quantizer, USAGES, state=s))
  sharded = jax.device_put(kernel, NamedSharding(mesh, SPECS[spec]))
  got = once(sharded, state)
  assert_same_bits(got, per_usage(sharded, state), f"{name} {spec}: vs each usage gathered")
  assert_same_bits(got, unsharded(kernel, state), f"{name} {spec}: vs the unsharded cast")
  jaxpr = str(jax.make_jaxpr(once)(sharded, state))
  assert ("jaxquant_cast[" in jaxpr) == (backend == "kernel")
  # One usage crosses the network: the gathered dim is its major dim.
  gathered = all_gathers(once.lower(sharded, state).compile().as_text())
  tensor_shards = 2 if "tensor" in tuple(SPECS[spec]) else 1
  assert gathered == [("u8", kernel.size // tensor_shards)], gathered


# Each preset with one kernel split (the other split is the other preset's): the splits
# and the presets are covered, at half the compile time of every pair.
@pytest.mark.parametrize("name, spec", [("fp8_current", "fsdp_k"), ("fp8_delayed", "fsdp_n")])
def test_train_step_is_the_unsharded_step(name, spec, eight_devices):
  # Loss, new delayed-scaling state and gradients (the kernel's, x's and the state's: the
  # grad_output amax) bit for bit. x is whole on every device and the kernel split over
  # the gathered axis alone, so that each GEMM sums as the unsharded one does (a batch
  # split reorders wgrad's sums over M, tensor parallelism dgrad's over N).
  recipe = recipes.get(name)
  mesh = mesh_2x2x2(eight_devices)
  kernel, x, target, state = _inputs(recipe)
  placed = (jax.device_put(kernel, NamedSharding(mesh, SPECS[spec])), x, target, state)
  assert_same_bits(
    _train_step(recipe, WeightGather(mesh, SPECS[spec]))(*placed),
    _train_step(recipe, None)(kernel, x, target, state),
    f"{name} {spec}",
  )


@pytest.mark.parametrize(
  "name, spec", [("fp8_current", "fsdp_x_tensor"), ("fp8_delayed", "fsdp_k")]
)
def test_fsdp_step_is_the_step_gathering_each_usage(name, spec, eight_devices):
  # With the batch split too (FSDP), and N over tensor (its dgrad sums over N shards):
  # the step of a weight quantizer whose usages are quantized and gathered one by one (a
  # hybrid of the same per-tensor FP8 quantizer: each usage's shards cast and gathered,
  # the columnwise one in the backward), bit for bit, delayed-scaling state included.
  recipe = recipes.get(name)
  mesh = mesh_2x2x2(eight_devices)
  quantizers = resolve_quantizers(recipe, None, "linear", "layer", "test")[0]
  weight = quantizers["weight"]
  each_usage = {**quantizers, "weight": HybridQuantizer(weight, weight)}
  gather = WeightGather(mesh, SPECS[spec])
  placed = _placed(mesh, SPECS[spec], *_inputs(recipe))
  step = lambda q: _train_step(None, gather, quantizers=q)
  assert_same_bits(step(quantizers)(*placed), step(each_usage)(*placed), f"{name} {spec}")
  tensor_shards = 2 if "tensor" in tuple(SPECS[spec]) else 1
  codes = lambda q: sum(
    n for t, n in all_gathers(step(q).lower(*placed).compile().as_text()) if t == "u8"
  )
  assert codes(each_usage) == 2 * codes(quantizers) == 2 * KERNEL[0] * KERNEL[1] // tensor_shards

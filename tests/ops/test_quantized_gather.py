"""The weight all-gathered in its quantized form (ops/_weight_gather.py), on 8 CPU devices.

- Codes and scales: quantizing each shard (amax reduced across shards) and gathering
  gives, bit for bit, what quantizing the whole weight gives, for every format and usage.
- `dense` with `weight_gather`: the loss and gradients of the sharded step without it, and
  the one-device loss, within fp32 rounding, for every preset; the
  compiled HLO all-gathers the weight only as 8-bit codes (and small scales).
- What cannot be gathered quantized is refused with the reason, or (fallback=True)
  gathered in high precision as without the option.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _sharded_checks import all_gathers, assert_same_bits, mesh_2x2x2
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant import recipes, scaling
from jaxquant.ops._operands import quantize_transposed_operand, resolve_quantizers
from jaxquant.ops._weight_gather import WeightGather, gather_operand, quantize_shards
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  DelayedFloat8Quantizer,
  Float8Quantizer,
  HybridQuantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

USAGES = ("rowwise", "columnwise")
KERNEL = (256, 128)  # [K, N]: 128 rows or cols per shard of two, whole 128x128 tiles
X_ROWS = 64

# Each format once, the kernel split three ways between them: K over fsdp (FSDP over the
# contraction dim), N over fsdp, and K over fsdp with N over tensor (FSDP x tensor parallel),
# each where the shards hold whole blocks.
# Not RHT: on the CPU the reference's exact-arithmetic host callback, which RHT sums reach,
# deadlocks against the amax pmax across the fake devices (as in test_primitives_cpu.py).
CASES = {
  "fp8_current": (Float8Quantizer("e5m2", eps=1e-3, pow2_scales=True), P("fsdp", None)),
  "fp8_delayed": (DelayedFloat8Quantizer(), P(None, "fsdp")),
  "block_1x128": (BlockFloat8Quantizer(), P("fsdp", None)),
  "block_128x128": (BlockFloat8Quantizer(block="128x128"), P("fsdp", None)),
  "mxfp8": (MXFP8Quantizer(), P(None, "fsdp")),
  "nvfp4": (NVFP4Quantizer(), P("fsdp", "tensor")),
  "nvfp4_16x16": (NVFP4Quantizer(tile_2d=True), P(None, "fsdp")),
  "nvfp4_per_token": (NVFP4Quantizer(per_token=True), P("fsdp", "tensor")),
  "hybrid_mxfp8_nvfp4": (HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()), P("fsdp", None)),
  "hybrid_fp8_none": (HybridQuantizer(Float8Quantizer(), None), P(None, "fsdp")),
}


def _kernel():
  return jax.random.normal(jax.random.key(1), KERNEL, jnp.float32) * 0.05


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.slow
def test_gathered_codes_and_scales_are_gather_then_quantize(name, eight_devices):
  quantizer, spec = CASES[name]
  mesh = mesh_2x2x2(eight_devices)
  gather = WeightGather(mesh, spec, "fsdp")
  kernel = _kernel().astype(jnp.bfloat16)
  state = None
  if isinstance(quantizer, DelayedFloat8Quantizer):
    # A scale that clips the largest values, and an amax already recorded this step.
    state = scaling.DelayedScalingState(
      jnp.zeros((4,), jnp.float32).at[0].set(0.01), jnp.float32(3000.0)
    )

  @jax.jit
  def quantized_gather(kernel, state):
    shards, new_state = quantize_shards(kernel, quantizer, USAGES, gather=gather, state=state)
    return {u: gather_operand(shards[u], u, gather) for u in USAGES}, new_state

  @jax.jit
  def gather_then_quantize(kernel, state):
    return quantize_transposed_operand(kernel, quantizer, USAGES, state=state)

  sharded = jax.device_put(kernel, NamedSharding(mesh, spec))
  assert_same_bits(quantized_gather(sharded, state), gather_then_quantize(kernel, state), name)
  gathered = all_gathers(quantized_gather.lower(sharded, state).compile().as_text())
  assert gathered and all(
    t == "u8" or (t == "f32" and n < kernel.size // 64) for t, n in gathered
  ), f"{name}: {gathered}"


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4_per_token"])
def test_kernel_primitives_cast_the_shards(name, eight_devices):
  # implementation="kernel" binds the cast and amax primitives inside the shard_map (on
  # a GPU the CUDA kernels run there; here their reference lowering).
  quantizer, spec = CASES[name]
  mesh = mesh_2x2x2(eight_devices)
  gather = WeightGather(mesh, spec, "fsdp")
  kernel = jax.device_put(_kernel().astype(jnp.bfloat16), NamedSharding(mesh, spec))

  def quantized_gather(implementation):
    shards, _ = quantize_shards(
      kernel, quantizer, USAGES, gather=gather, implementation=implementation
    )
    return {u: gather_operand(shards[u], u, gather) for u in USAGES}

  assert_same_bits(
    jax.jit(lambda: quantized_gather("kernel"))(),
    jax.jit(lambda: quantized_gather("reference"))(),
    name,
  )


def _dense_step(recipe, weight_gather):
  """jit'd (loss, new_state) and gradients of a dense layer's squared error."""

  def loss(kernel, x, target, state, key):
    out = jq.dense(
      x, kernel, recipe=recipe, name="layer", key=key, state=state, weight_gather=weight_gather
    )
    y, new_state = out if state is not None else (out, None)
    return jnp.mean(jnp.square(y.astype(jnp.float32) - target)), new_state

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3), has_aux=True))


@pytest.mark.parametrize("name", sorted(recipes.PRESETS))
@pytest.mark.slow
def test_sharded_dense_step(name, eight_devices):
  recipe = recipes.get(name)
  mesh = mesh_2x2x2(eight_devices)
  spec = P("fsdp", None)
  keys = jax.random.split(jax.random.key(0), 3)
  # fp32 activations: the sharded GEMMs may sum in another order (K split), within fp32
  # rounding of the one-device sums; bf16 outputs would round those partial sums to bf16.
  x = jax.random.normal(keys[0], (X_ROWS, KERNEL[0]), jnp.float32)
  target = jax.random.normal(keys[1], (X_ROWS, KERNEL[1]), jnp.float32)
  kernel = _kernel()
  quantizers = resolve_quantizers(recipe, None, "linear", "layer", name)[0]
  state = {
    t: scaling.init_state(q) for t, q in quantizers.items() if isinstance(q, DelayedFloat8Quantizer)
  } or None
  args = (kernel, x, target, state, keys[2])
  placed = (
    jax.device_put(kernel, NamedSharding(mesh, spec)),
    jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None))),
    target,
    state,
    keys[2],
  )

  one_device = _dense_step(recipe, None)(*args)
  plain = _dense_step(recipe, None).lower(*placed).compile()
  gathered = _dense_step(recipe, WeightGather(mesh, spec, "fsdp")).lower(*placed).compile()
  sharded, with_gather = plain(*placed), gathered(*placed)

  # The GEMMs see the same operand bits with or without the quantized gather (the codes
  # test above); XLA may still partition a GEMM's sums differently in the two programs
  # (e.g. wgrad over M), so the results agree within fp32 rounding of those sums.
  for i, (got, want) in enumerate(
    zip(jax.tree.leaves(with_gather), jax.tree.leaves(sharded), strict=False)
  ):
    np.testing.assert_allclose(
      got,
      want,
      rtol=1e-6,
      atol=1e-6 * float(np.max(np.abs(want))),
      err_msg=f"{name}: quantized gather vs plain sharded step, leaf {i}",
    )
  (loss, _), _ = sharded
  (loss_one, _), _ = one_device
  np.testing.assert_allclose(loss, loss_one, rtol=1e-6, err_msg=f"{name}: sharded vs one device")
  np.testing.assert_allclose(
    with_gather[0][0], loss_one, rtol=1e-6, err_msg=f"{name}: quantized gather vs one device"
  )

  if name == "bf16":
    return  # nothing quantized: XLA places the kernel as without the option
  # The weight crosses the devices as 8-bit codes (NVFP4: packed, half the elements),
  # never whole in a wider type. (Without the option XLA picks per recipe: a wide gather
  # of the kernel, or GEMMs over K shards with their outputs all-reduced.)
  # (x and dy, smaller than the kernel here, may be gathered for their columnwise blocks.)
  gathers = all_gathers(gathered.as_text())
  assert [n for t, n in gathers if t == "u8" and n in (kernel.size, kernel.size // 2)], (
    f"{name}: {gathers}"
  )
  assert not [n for t, n in gathers if t != "u8" and n == kernel.size], f"{name}: {gathers}"


def _lower_dense(recipe, gather, kernel_shape=KERNEL):
  x = jax.ShapeDtypeStruct((X_ROWS, kernel_shape[0]), jnp.bfloat16)
  kernel = jax.ShapeDtypeStruct(kernel_shape, jnp.float32)
  f = lambda x, k: jq.dense(
    x, k, recipe=recipe, name="layer", key=jax.random.key(0), weight_gather=gather
  )
  return jax.jit(jax.grad(lambda x, k: f(x, k).astype(jnp.float32).sum(), argnums=1)).lower(
    x, kernel
  )


def test_errors_and_fallback(eight_devices):
  mesh = mesh_2x2x2(eight_devices)
  # A shard of 64 rows of w (N split in two) cuts the 128x128 tiles of block FP8 weights.
  with pytest.raises(
    ValueError, match=r"each shard holds 64 rows, not a multiple of the block's 128"
  ):
    _lower_dense(recipes.fp8_block, WeightGather(mesh, P(None, "fsdp")))
  # Stochastic rounding on the weight: one random stream over the whole weight.
  sr = recipes.CustomRecipe(lambda role: NVFP4Quantizer(stochastic_rounding=True))
  with pytest.raises(ValueError, match="rounds stochastically"):
    _lower_dense(sr, WeightGather(mesh, P("fsdp", None)))
  # fallback=True: such a weight is gathered in high precision and quantized after.
  hlo = _lower_dense(sr, WeightGather(mesh, P("fsdp", None), fallback=True)).as_text()
  assert "shard_map" not in hlo and "manual_computation" not in hlo
  with pytest.raises(ValueError, match="does not shard over axis 'fsdp'"):
    WeightGather(mesh, P("tensor", None))
  with pytest.raises(ValueError, match="'model' is not in the mesh's axes"):
    WeightGather(mesh, P("model", None), "model")
  with pytest.raises(ValueError, match="mixing gathered axes"):
    WeightGather(mesh, P(("fsdp", "tensor"), None))
  with pytest.raises(TypeError, match="weight_gather must be a WeightGather"):
    _lower_dense(recipes.fp8_current, "fsdp")

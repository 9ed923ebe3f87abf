"""The CUDA kernels under a sharded jit on several GPUs (skipped with fewer than two).

Each device runs the kernel on its shard through the partition rules of kernels/*.py;
the CPU suite checks the same rules with the reference lowering (test_primitives_cpu.py),
this one that the FFI calls take shards: casts and dequantization give one device's bits
and never gather their input, GEMMs match one device's result.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_cases import (
  BF16_MMA_TOLERANCE,
  FP8_MMA_TOLERANCE,
  assert_same_bits,
  random_input,
  relative_error,
)

import jaxquant
from jaxquant import kernels, reference
from jaxquant.kernels import _gemm_values as gemm_values
from jaxquant.kernels import _grouped as grouped
from jaxquant.ops import _gemm as gemm_ops
from jaxquant.quantizers import (
  BlockFloat8Quantizer,
  Float8Quantizer,
  MXFP8Quantizer,
  NVFP4Quantizer,
)

pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(not kernels.available(), reason=f"{kernels.unavailable_reason()}"),
]

BOTH = ("rowwise", "columnwise")


@pytest.fixture
def mesh():
  devices = jax.devices()
  if len(devices) < 2:
    pytest.skip(f"needs 2 GPUs, {jax.default_backend()} has {len(devices)}")
  return Mesh(np.array(devices), ("d",))


def _gathers(hlo: str, dtype: str, shape) -> bool:
  return bool(re.search(rf"{dtype}\[{','.join(map(str, shape))}\][^ ]* all-gather", hlo))


QUANTIZERS = {
  "fp8_current": Float8Quantizer(),
  "mxfp8": MXFP8Quantizer(),
  "nvfp4_per_token": NVFP4Quantizer(per_token=True),
  "nvfp4_rht": NVFP4Quantizer(rht=True),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")], ids=str)
def test_cast_takes_shards(mesh, name, spec):
  quantizer = QUANTIZERS[name]
  x = random_input(1, (1024, 2048), jnp.bfloat16)
  want = kernels.quantize_usages(x, quantizer, BOTH)
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  f = jax.jit(lambda x: kernels.quantize_usages(x, quantizer, BOTH))
  assert_same_bits(f(xs), want, f"{name} sharded {spec}")
  assert not _gathers(f.lower(xs).compile().as_text(), "bf16", x.shape), "input gathered"


@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")], ids=str)
def test_nvfp4_values_take_shards(mesh, spec):
  """The NVFP4 values kernel (the RHT's columnwise usage too) on each device's shard, with
  the global amaxes: one device's bits, and the input never gathered."""
  quantizer = NVFP4Quantizer(rht=True)
  x = random_input(1, (1024, 2048), jnp.bfloat16)
  f = jax.jit(lambda x: gemm_values.nvfp4_values(x, quantizer, BOTH))
  want = f(x)
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  assert_same_bits(f(xs), want, f"sharded {spec}")
  assert not _gathers(f.lower(xs).compile().as_text(), "bf16", x.shape), "input gathered"


@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")], ids=str)
def test_dequantize_takes_shards(mesh, spec):
  stored = reference.quantize(random_input(2, (1024, 2048), jnp.bfloat16), NVFP4Quantizer()).rowwise
  f = jax.jit(lambda qd: kernels.dequantize_data(qd, jnp.bfloat16, block_scales_only=True))
  want = f(stored)
  placed = jax.tree.map(
    lambda a: jax.device_put(a, NamedSharding(mesh, spec if a.ndim == 2 else P())), stored
  )
  assert_same_bits(f(placed), want, f"dequantize sharded {spec}")
  assert not _gathers(f.lower(placed).compile().as_text(), "u8", stored.data.shape), (
    "codes gathered"
  )


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize(
  "spec_a,spec_b",
  [(P("d", None), P()), (P(), P("d", None)), (P(None, "d"), P(None, "d"))],
  ids=["data_parallel", "weight_rows", "split_k"],
)
def test_dequantize_first_gemm_takes_shards(mesh, name, spec_a, spec_b):
  """The MXFP8 / NVFP4 GEMM of more than 32 rows (dequantize kernel, then XLA's bf16 GEMM,
  or for NVFP4's S_dec the scaled bf16 GEMM) with A's rows (tokens), B's rows (a
  column-parallel weight) or K alike in both (a weight gradient's tokens) sharded: one
  device's result."""
  q = MXFP8Quantizer() if name == "mxfp8" else NVFP4Quantizer()
  a = reference.quantize(random_input(3, (1024, 2048), jnp.bfloat16), q).rowwise
  b = reference.quantize(random_input(4, (512, 2048), jnp.bfloat16), q).rowwise
  f = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.float32))
  want = np.asarray(f(a, b), np.float64)
  place = lambda qd, spec: jax.tree.map(  # NVFP4's global amax stays whole
    lambda t: jax.device_put(t, NamedSharding(mesh, spec if t.ndim == 2 else P())), qd
  )
  got = np.asarray(f(place(a, spec_a), place(b, spec_b)), np.float64)
  assert relative_error(got, want) <= 1e-5


def _quantized(seed, shape, quantizer):
  return reference.quantize(
    random_input(seed, shape, jnp.bfloat16), quantizer, ("rowwise",)
  ).rowwise


# The GEMMs whose workspace is a result buffer sized when the call is lowered: under a
# sharded jit it is sized for each device's shard (the cuBLASLt GEMMs, per-tensor FP8 and
# NVFP4's dequantize-first GEMM, take theirs only there).
WORKSPACE_GEMMS = {  # name: (A's and B's (seed, shape, quantizer), tolerance)
  "fp8_tensor": (
    ((13, (1024, 2048), Float8Quantizer()), (14, (512, 2048), Float8Quantizer())),
    FP8_MMA_TOLERANCE,
  ),
  "nvfp4_dequantize_first": (
    ((15, (1024, 2048), NVFP4Quantizer()), (16, (512, 2048), NVFP4Quantizer())),
    BF16_MMA_TOLERANCE,
  ),
  "block_fp8": (
    (
      (7, (1024, 2048), BlockFloat8Quantizer(block="1x128")),
      (8, (512, 2048), BlockFloat8Quantizer(block="128x128")),
    ),
    FP8_MMA_TOLERANCE,
  ),
  "fused_dequant_m32": (
    ((9, (32, 2048), MXFP8Quantizer()), (10, (1024, 2048), NVFP4Quantizer())),
    BF16_MMA_TOLERANCE,
  ),
}


def _workspace_gemm_operands(name):
  return [_quantized(*operand) for operand in WORKSPACE_GEMMS[name][0]]


def _placed(mesh, qd, spec):
  """A usage's data with `spec` (its scales, scalars or vectors, replicated)."""
  return jax.tree.map(
    lambda t: jax.device_put(t, NamedSharding(mesh, spec if t.ndim == 2 else P())), qd
  )


@pytest.mark.parametrize("name", sorted(WORKSPACE_GEMMS))
@pytest.mark.parametrize(
  "spec_a,spec_b", [(P("d", None), P()), (P(), P("d", None))], ids=["data_parallel", "weight_rows"]
)
def test_gemm_with_workspace_takes_shards(mesh, name, spec_a, spec_b):
  a, b = _workspace_gemm_operands(name)
  f = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.float32))
  want = np.asarray(f(a, b), np.float64)
  got = np.asarray(f(_placed(mesh, a, spec_a), _placed(mesh, b, spec_b)), np.float64)
  assert relative_error(got, want) <= WORKSPACE_GEMMS[name][1]


@pytest.mark.parametrize(
  "name,target",
  [
    ("fp8_tensor", "jaxquant_fp8_tensor_gemm"),
    ("nvfp4_dequantize_first", "jaxquant_scaled_bf16_gemm"),
  ],
)
def test_cublaslt_gemm_takes_its_workspace_only_across_devices(mesh, name, target):
  """One device: the call's only result is D, which XLA's fusions may overwrite in place.
  Sharded: D and cuBLASLt's workspace (uint8), for its dynamically scheduled kernels."""
  a, b = _workspace_gemm_operands(name)
  f = jax.jit(lambda a, b: gemm_ops.gemm(a, b, out_dtype=jnp.float32))
  for args, with_workspace in (((a, b), False), ((_placed(mesh, a, P("d", None)), b), True)):
    hlo = f.lower(*args).compile().as_text()
    calls = [line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]
    assert calls, f"no {target} call"
    for call in calls:
      result = call.split(" = ", 1)[1].split(" custom-call(", 1)[0]
      assert ("u8[" in result) == with_workspace, call[:300]


def test_grouped_gemm_with_sharded_tokens(mesh):
  """The grouped kernel is kept whole under a sharded jit (its operands are gathered)."""
  a = random_input(11, (1024, 256), jnp.bfloat16)
  b = random_input(12, (4 * 256, 256), jnp.bfloat16).reshape(4, 256, 256)
  sizes, alpha = jnp.asarray([300, 0, 500, 200], jnp.int32), jnp.ones((4,), jnp.float32)
  f = jax.jit(lambda a: grouped.grouped_gemm(a, b, sizes, alpha))
  want = np.asarray(f(a), np.float64)
  got = np.asarray(f(jax.device_put(a, NamedSharding(mesh, P("d", None)))), np.float64)
  assert relative_error(got, want) <= BF16_MMA_TOLERANCE


def _nvfp4_rounding_to_nearest(role):
  """The nvfp4 recipe without stochastic rounding: each device's random stream differs
  from one device's, rounding to nearest is the same on any sharding."""
  q = jaxquant.recipes.nvfp4_factory(role)
  return dataclasses.replace(q, stochastic_rounding=False)


@pytest.mark.parametrize(
  "recipe",
  [
    jaxquant.recipes.fp8_current,
    jaxquant.recipes.mxfp8,
    jaxquant.recipes.CustomRecipe(_nvfp4_rounding_to_nearest, name="nvfp4_rne"),
  ],
  ids=lambda r: r.name,
)
def test_dense_training_step_data_parallel(mesh, recipe):
  """Forward and backward of `dense` with the tokens sharded: per-tensor amaxes are global
  (pmax in the cast's partition), so every quantized value is one device's, and the
  outputs and gradients match one device's up to the sums' order (bf16 outputs). (mxfp8
  and nvfp4_rne cast straight to the values their GEMMs multiply.)"""
  x = random_input(5, (1024, 512), jnp.bfloat16)
  kernel = (random_input(6, (512, 256), jnp.bfloat16) * 0.05).astype(jnp.bfloat16)

  def loss(x, kernel):
    y = jaxquant.dense(x, kernel, recipe=recipe, name="mlp")
    return jnp.sum(y.astype(jnp.float32) ** 2), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, y1), (dx1, dk1) = step(x, kernel)
  xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
  (_, y2), (dx2, dk2) = step(xs, kernel)
  for name, got, want in (("y", y2, y1), ("dx", dx2, dx1), ("dkernel", dk2, dk1)):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # One bf16 rounding of sums that differ only in order: within a bf16 ulp each.
    assert relative_error(got, want) <= 2.0**-8, name

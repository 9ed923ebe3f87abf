"""Per-shard current scaling (ops/_shard_scaling.py), on 8 CPU devices.

- `dense` with `shard_scaling` computes what `dense` gives on each shard's rows alone:
  y and dx bit for bit, the kernel's gradient the sum of the shards' gradients (summed
  across devices in the kernel's dtype, so within that sum's rounding); with shards of
  different magnitudes, not what the per-tensor call gives.
- The compiled step reduces no amax of the input or the output gradient across devices.
- What it cannot take is refused at trace time, naming the rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo_checks import max_reduced_values
from _sharded_checks import assert_same_bits
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxquant import ops
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer

QUANTIZERS = {
  "input": Float8Quantizer(),
  "weight": Float8Quantizer(),
  "grad_output": Float8Quantizer("e5m2"),
}
M, K, N = 128, 256, 128
SHARDS = 8


def _operands():
  """x, kernel, dy; each shard's rows of x and dy at their own magnitude, so that the
  shards' amaxes, hence their scales, differ."""
  rows = jnp.repeat(jnp.arange(SHARDS), M // SHARDS)[:, None]
  x = jax.random.normal(jax.random.key(0), (M, K), jnp.float32) * 10.0 ** (rows % 4)
  kernel = jax.random.normal(jax.random.key(1), (K, N), jnp.float32) * 0.05
  dy = jax.random.normal(jax.random.key(2), (M, N), jnp.float32) * 3.0 ** (rows % 3)
  return x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)


def _value_and_grads(x, kernel, dy, **options):
  y, vjp = jax.vjp(lambda x, k: ops.dense(x, k, quantizers=QUANTIZERS, **options), x, kernel)
  return (y, *vjp(dy))


def _meshes(devices):
  """(mesh, row axes, kernel spec, weight gather or None): rows over three axes with the
  kernel replicated (wgrad all-reduced), and over one FSDP axis with the kernel's K split
  and gathered quantized (wgrad reduce-scattered along K)."""
  three = Mesh(np.array(devices).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  one = Mesh(np.array(devices), ("fsdp",))
  return {
    "rows_over_three_axes": (three, ("data", "fsdp", "tensor"), P(), None),
    "fsdp_with_weight_gather": (
      one,
      ("fsdp",),
      P("fsdp", None),
      ops.WeightGather(one, P("fsdp", None), "fsdp"),
    ),
  }


def _placed(mesh, axes, kernel_spec):
  """x, kernel, dy on the mesh: x's and dy's rows split over `axes`."""
  rows = NamedSharding(mesh, P(axes, None))
  shardings = (rows, NamedSharding(mesh, kernel_spec), rows)
  return [jax.device_put(a, s) for a, s in zip(_operands(), shardings, strict=True)]


@pytest.mark.parametrize("case", ["rows_over_three_axes", "fsdp_with_weight_gather"])
def test_each_shard_is_quantized_and_multiplied_alone(case, eight_devices):
  mesh, axes, kernel_spec, gather = _meshes(eight_devices)[case]
  x, kernel, dy = _operands()
  placed = _placed(mesh, axes, kernel_spec)
  options = dict(shard_scaling=ops.ShardScaling(mesh, axes), weight_gather=gather)
  step = jax.jit(lambda *a: _value_and_grads(*a, **options))
  y, dx, dkernel = step(*placed)
  # With the kernel's K split over the row axis, its gradient is reduce-scattered there.
  assert ("reduce-scatter" in step.lower(*placed).compile().as_text()) == (gather is not None)

  # The oracle: dense on each shard's rows, unsharded.
  rows = M // SHARDS
  shards = [
    jax.jit(_value_and_grads)(x[i * rows : (i + 1) * rows], kernel, dy[i * rows : (i + 1) * rows])
    for i in range(SHARDS)
  ]
  assert_same_bits(y, jnp.concatenate([s[0] for s in shards]), "y")
  assert_same_bits(dx, jnp.concatenate([s[1] for s in shards]), "dx")
  # The shards' kernel gradients, bf16 each, are added across devices in bf16: each of
  # the SHARDS - 1 additions rounds by at most 2^-8 of a partial sum, itself at most the
  # sum of the magnitudes.
  partials = np.stack([np.asarray(s[2], np.float64) for s in shards])
  bound = (SHARDS - 1) * 2.0**-8 * np.abs(partials).sum(0)
  error = np.abs(np.asarray(dkernel, np.float64) - partials.sum(0))
  assert dkernel.dtype == kernel.dtype
  assert (error <= bound).all(), f"max error {error.max()} over its bound"

  if gather is None:  # (one case is enough) not the per-tensor scaling's values
    y_tensor = jax.jit(lambda *a: _value_and_grads(*a)[0])(*placed)
    assert not np.array_equal(np.asarray(y), np.asarray(y_tensor))


def test_no_amax_of_the_rows_is_reduced_across_devices(eight_devices):
  mesh = Mesh(np.array(eight_devices), ("fsdp",))
  # The kernel replicated: its amax needs no reduction either.
  placed = _placed(mesh, ("fsdp",), P())

  def count(**options):
    step = jax.jit(lambda *a: _value_and_grads(*a, **options))
    return len(max_reduced_values(step.lower(*placed).compile().as_text()))

  assert count() > 0  # per tensor: x's and dy's amaxes
  assert count(shard_scaling=ops.ShardScaling(mesh, "fsdp")) == 0


def test_refusals(eight_devices):
  mesh = Mesh(np.array(eight_devices), ("fsdp",))
  scaling = ops.ShardScaling(mesh, "fsdp")
  x, kernel, _ = _operands()
  dense = lambda x, **options: jax.eval_shape(
    lambda x, k: ops.dense(x, k, **{"quantizers": QUANTIZERS, **options}), x, kernel
  )
  with pytest.raises(ValueError, match="grad_output.*Float8Quantizer.*DelayedFloat8Quantizer"):
    delayed = dict(QUANTIZERS, grad_output=DelayedFloat8Quantizer())
    dense(x, quantizers=delayed, shard_scaling=scaling)
  with pytest.raises(ValueError, match="backward='quantized'"):
    dense(x, backward="dequantized", shard_scaling=scaling)
  with pytest.raises(ValueError, match=r"\(8 shards\).*M=100 rows"):
    dense(x[:100], shard_scaling=scaling)
  with pytest.raises(TypeError, match="ShardScaling or None"):
    dense(x, shard_scaling="fsdp")
  with pytest.raises(ValueError, match=r"\{'tensor': 2\}.*tensor parallelism"):
    ops.ShardScaling(Mesh(np.array(eight_devices).reshape(4, 2), ("fsdp", "tensor")), "fsdp")
  with pytest.raises(ValueError, match="'data' is not in the mesh"):
    ops.ShardScaling(mesh, "data")

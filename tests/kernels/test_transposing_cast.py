"""`kernels.quantize_transposing` (per-tensor FP8, rowwise codes by XLA's convert, columnwise
codes their transpose) bit for bit against the reference quantizer, for current and
delayed scaling, both elements, every input dtype, fresh random inputs and NUMERICS.md's
edge cases. Off the GPU the transpose runs its reference lowering; on a GPU with the
kernels the same tests check XLA:GPU's convert and the transpose kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import assert_same_bits, edge_input, random_input

from jaxquant import kernels, reference, scaling
from jaxquant.quantizers import DelayedFloat8Quantizer, Float8Quantizer

BOTH = ("rowwise", "columnwise")
CURRENT = {
  "e4m3": Float8Quantizer(),
  "e5m2_pow2_eps": Float8Quantizer("e5m2", eps=1e-3, pow2_scales=True),
}
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
dtype_id = lambda d: jnp.dtype(d).name


def inputs(dtype):
  """Fresh random values and the edge matrix (zeros, signed zeros, subnormals, ties, inf
  and NaN), each [64, 48]."""
  seed = int(np.random.default_rng().integers(1 << 30))
  return {
    f"random(seed={seed})": random_input(seed, (64, 48), dtype),
    "edges": edge_input((64, 48), dtype, nan=True, inf=True),
    "edges_finite": edge_input((64, 48), dtype, nan=False, inf=False),
  }


def usages_of(qt):
  return {u: qt.usage(u) for u in BOTH}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", sorted(CURRENT))
def test_current_scaling_is_the_reference(name, dtype):
  q = CURRENT[name]
  fn = jax.jit(lambda x: kernels.quantize_transposing(x, q, BOTH))
  for what, x in inputs(dtype).items():
    got, observed = fn(x)
    assert observed is None
    assert_same_bits(got, usages_of(reference.quantize(x, q, BOTH)), f"{name} {what}")


# Scales across fp32's range: huge ones make bf16 subnormal inputs encode to nonzero codes
# (a backend flushing subnormal operands would zero them), tiny ones flush everything.
DELAYED_SCALES = [1.0, 3.7, 2.0**100, 2.0**-100, 448.0 / 1e-30]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_delayed_scaling_is_the_reference_and_observes_the_amax(element, dtype):
  q = DelayedFloat8Quantizer(element)
  fn = jax.jit(lambda x, s: kernels.quantize_transposing(x, q, BOTH, scale=s))
  for scale in DELAYED_SCALES:
    state = scaling.DelayedScalingState(scaling.init_state(q).amax_history, jnp.float32(scale))
    for what, x in inputs(dtype).items():
      got, observed = fn(x, state.scale)
      want, want_state = reference.quantize(x, q, BOTH, state=state)
      assert_same_bits(got, usages_of(want), f"{element} scale {scale} {what}")
      assert_same_bits(
        scaling.record_amax(state, observed), want_state, f"{element} amax {scale} {what}"
      )

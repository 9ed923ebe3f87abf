"""What the NVFP4 reference costs in a training step, against bf16's.

The CPU runs the reference by default (the kernels are CUDA), README's main job included,
so one dense layer's forward and backward under the nvfp4 recipe (RHT and stochastic
rounding on the wgrad operands, 16x16 weight tiles) must fit where bf16's does. Its exact
fp32 arithmetic is elementwise and fuses; what made it large and slow to compile were
exact-arithmetic fallbacks run on every element of operand-sized arrays (a host callback,
a reduction over the whole array and a conditional per operation, against constants XLA
then spent tens of seconds folding) and an RHT that laid out all 16 terms of every output
at once. At 4096x2048x2048 that step took 1.6 GiB of temporaries (bf16: 144 MiB) and
about a minute to compile.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

import jaxquant
from jaxquant import recipes

# x [M, K], kernel [K, N]: a small layer with every NVFP4 block dim a multiple of 16.
M, K, N = 512, 256, 256
# XLA temporaries of the nvfp4 step at most this many times bf16's (measured here: about 1.2
# under JAX 0.10, 2.5 under 0.12, whose bf16 step takes less).
TEMP_RATIO_BOUND = 4.0


def _compiled_step(recipe):
  """The jitted forward and backward (vjp with a given dy) of one dense layer, compiled
  for the CPU with the reference."""

  def step(x, kernel, dy, key):
    y, vjp = jax.vjp(lambda x, kernel: jaxquant.dense(x, kernel, recipe=recipe, key=key), x, kernel)
    return (y, *vjp(dy))

  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (M, K), jnp.bfloat16)
  kernel = jax.random.normal(keys[1], (K, N), jnp.bfloat16) * 0.05
  dy = jax.random.normal(keys[2], (M, N), jnp.bfloat16) * 1e-3
  return jax.jit(step).lower(x, kernel, dy, keys[3]).compile()


@pytest.fixture(scope="module")
def steps():
  with pytest.MonkeyPatch.context() as patch, jax.default_device(jax.devices("cpu")[0]):
    patch.setenv("JAXQUANT_BACKEND", "reference")
    return {name: _compiled_step(recipes.get(name)) for name in ("bf16", "nvfp4")}


def test_nvfp4_step_temporaries_within_bound_of_bf16(steps):
  temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in steps.items()}
  assert temp["nvfp4"] <= TEMP_RATIO_BOUND * temp["bf16"], (
    f"nvfp4 step takes {temp['nvfp4'] / 2**20:.1f} MiB of XLA temporaries, "
    f"{temp['nvfp4'] / temp['bf16']:.1f}x bf16's {temp['bf16'] / 2**20:.1f} MiB "
    f"(bound {TEMP_RATIO_BOUND}x)"
  )


_CALLBACK = re.compile(r"=\s*(.*?)\s*custom-call\(.*custom_call_target=\"[^\"]*callback[^\"]*\"")
_SHAPE = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def test_nvfp4_step_exact_fallbacks_run_per_block_not_per_element(steps):
  """The structure behind the compile time: exact fp32 fallbacks (a host callback under a
  conditional on a whole-array check) only where a value per block is computed (the
  scales), never on operand-sized arrays, whose checks XLA folded for tens of seconds."""
  sizes = [
    max((math.prod(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(result)))
    for result in _CALLBACK.findall(steps["nvfp4"].as_text())
  ]
  assert sizes, "no host callback found: the scales' exact fallbacks should show in the HLO"
  per_block = M * max(K, N) // 16
  assert max(sizes) <= per_block, (
    f"a host callback on {max(sizes)} elements (one per 16-element block: {per_block})"
  )

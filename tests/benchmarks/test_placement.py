"""benchmarks/placement.py on the CPU: XLA's convert computes the reference's FP8 codes, each
placement moves the per-tensor FP8 quantization as it says (the kernel
primitives are traced on the CPU with their reference lowering), every placement's step
computes the same loss bit for bit, and the kernels come back after each placement."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import placement  # noqa: E402
import step  # noqa: E402
import step_variants  # noqa: E402
from step_model import SHAPES, DecoderStack  # noqa: E402

from jaxquant import kernels  # noqa: E402
from jaxquant.kernels import _quantize as kernel_quantize  # noqa: E402


def test_xla_convert_gives_the_reference_codes():
  assert placement.xla_codes_differ() == 0


@pytest.fixture(scope="module")
def step_inputs():
  stock = DecoderStack(SHAPES["tiny"], 1, attention="xla")
  params = step.init_variables(stock, stock.shape.d_model)["params"]
  x = jax.random.normal(jax.random.key(1), (1, 128, stock.shape.d_model), jnp.bfloat16)
  return stock, params, x


def _jaxpr_and_loss(preset, stock, params, x):
  variant = step_variants.build(preset, stock)
  collections = step.variant_collections(variant, params, stock.shape.d_model)
  tx = optax.adamw(1e-4)
  args = (params, tx.init(params), collections, x, jax.random.key(0))
  train_step = step.train_step(variant, tx)
  jaxpr = str(jax.make_jaxpr(train_step)(*args))
  return jaxpr, np.asarray(jax.jit(train_step)(*args)[3])


@pytest.mark.parametrize("preset", ["fp8_current", "fp8_delayed"])
def test_placements_move_the_quantization_and_keep_the_loss(step_inputs, preset, monkeypatch):
  monkeypatch.setenv("JAXQUANT_BACKEND", "kernel")  # the kernel primitives, lowered for the CPU
  originals = kernel_quantize.tensor_amax, kernels.quantize_usages_and_amax
  found = {}
  for name in placement.PLACEMENTS:
    with placement.placed(name):
      found[name] = _jaxpr_and_loss(preset, *step_inputs)
    assert (kernel_quantize.tensor_amax, kernels.quantize_usages_and_amax) == originals
  jaxprs = {name: jaxpr for name, (jaxpr, _) in found.items()}
  amaxes = {name: jaxpr.count("jaxquant_amax[") for name, jaxpr in jaxprs.items()}
  casts = {name: jaxpr.count("jaxquant_cast[") for name, jaxpr in jaxprs.items()}
  assert casts["default"] > 0 and casts["amax_kernel"] == casts["default"]
  assert casts["xla_cast"] == 0 and 0 < casts["xla_rowwise_cast"]
  if preset == "fp8_current":
    assert amaxes["amax_kernel"] > 0
  assert amaxes["default"] == amaxes["xla_cast"] == amaxes["xla_rowwise_cast"] == 0
  losses = {name: loss.tobytes() for name, (_, loss) in found.items()}
  assert len(set(losses.values())) == 1, losses

"""The NNX swap-in under `nnx.jit` on a module's own method: an inner module whose
`__call__` is wrapped in `nnx.jit` follows the recipe of every call of the quantized model.

`nnx.jit` caches its trace per decorated function, keyed by the graphdef of its module
arguments (their types and static attributes) and the arguments' shapes; the routed
contractions and the swap-in's rows exist only while a trace runs. So a second call of
the quantized model, another model of the same class under another recipe, and a call of
the module outside the model's session must each trace anew.
"""

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.errors import TraceContextError

import jaxquant.flax as jqf
from jaxquant import ops

D = 64
LAYERS = 2


class OwnEinsum(nnx.Module):
  """A weight contracted by the module's own code (routed), `__call__` under nnx.jit."""

  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.05)

  @nnx.jit
  def __call__(self, x):
    return jnp.einsum("bd,de->be", x, self.w[...])


class Block(nnx.Module):
  """The own einsum and a swapped stock layer, `__call__` under nnx.jit too."""

  def __init__(self, rngs):
    self.own = OwnEinsum(rngs)
    self.fc = nnx.Linear(D, D, rngs=rngs)

  @nnx.jit
  def __call__(self, x):
    return self.fc(self.own(x))


class Model(nnx.Module):
  def __init__(self, rngs):
    self.block = Block(rngs)

  def __call__(self, x):
    return self.block(x)


class ScannedModel(nnx.Module):
  """Jitted layers stacked by nnx.vmap, run by nnx.scan of nnx.remat."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return OwnEinsum(rngs)

    self.layers = stacked(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def through(x, layer):
      return layer(x)

    return through(x, self.layers)


def inputs():
  return jax.random.normal(jax.random.key(1), (32, D))


def expected(model: Model, x, recipe) -> np.ndarray:
  """The model's two GEMMs through jaxquant's ops."""
  block = model.block
  h = ops.dense(x, block.own.w[...], recipe=recipe)
  return np.asarray(ops.dense(h, block.fc.kernel[...], block.fc.bias[...], recipe=recipe))


def test_quantized_model_called_twice():
  x = inputs()
  model = jqf.quantize_model(Model(nnx.Rngs(0)), "fp8_current")
  graphdef = nnx.graphdef(model)
  fp8 = expected(model, x, "fp8_current")
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(model(x)), fp8)
  assert nnx.graphdef(model) == graphdef  # the session's token is gone after the call
  for _ in range(2):
    report = jqf.swap_report(model, x)
    assert sorted(r.role for r in report.quantized) == ["block/fc", "block/own/w"], str(report)


def test_models_of_one_class_under_recipes_in_turn():
  x = inputs()
  plain = np.asarray(Model(nnx.Rngs(0))(x))
  for recipe in ["fp8_current", "mxfp8", "bf16"]:
    model = jqf.quantize_model(Model(nnx.Rngs(0)), recipe)
    want = plain if recipe == "bf16" else expected(model, x, recipe)
    assert recipe == "bf16" or not np.array_equal(want, plain)
    np.testing.assert_array_equal(np.asarray(model(x)), want, err_msg=recipe)


def test_one_model_called_plain_then_quantized_under_recipes_in_turn():
  x = inputs()
  model = Model(nnx.Rngs(0))
  plain = np.asarray(model(x))
  for recipe in ["fp8_current", "bf16"]:
    jqf.quantize_model(model, recipe)
    want = plain if recipe == "bf16" else expected(model, x, recipe)
    np.testing.assert_array_equal(np.asarray(model(x)), want, err_msg=recipe)


def test_module_called_outside_the_session_runs_as_written():
  """A quantized model's module called by itself (no session) and the model's calls, in
  turn: neither reuses the other's trace."""
  x = inputs()
  model = jqf.quantize_model(Model(nnx.Rngs(0)), "fp8_current")
  w = model.block.own.w[...]
  as_written = np.asarray(jax.jit(lambda x, w: jnp.einsum("bd,de->be", x, w))(x, w))
  assert not np.array_equal(as_written, np.asarray(ops.dense(x, w, recipe="fp8_current")))
  np.testing.assert_array_equal(np.asarray(model.block.own(x)), as_written)
  np.testing.assert_array_equal(np.asarray(model(x)), expected(model, x, "fp8_current"))
  np.testing.assert_array_equal(np.asarray(model.block.own(x)), as_written)


def test_the_first_call_logs_the_jitted_layers_gemms_as_weight_gemms(caplog):
  """A gradient through the jitted modules traces their quantized GEMMs' backward while
  the model's call still runs: the log line counts those GEMMs once each, as weight GEMMs,
  and no contraction of their backward as another contraction."""
  caplog.set_level(logging.INFO, logger="jaxquant")
  model = jqf.quantize_model(Model(nnx.Rngs(0)), "fp8_current")
  x = inputs()
  nnx.jit(nnx.grad(lambda model: jnp.sum(model(x) ** 2)))(model)
  (line,) = [r.getMessage() for r in caplog.records if r.name == "jaxquant"]
  assert line == (
    "quantize_model(Model) under recipe 'fp8_current': 2 of 2 weight GEMMs quantized, "
    "0 in high precision; 0 other contractions (no param operand) in high precision"
  )


def test_jitted_layers_under_scan_and_remat():
  x = inputs()
  plain = np.asarray(ScannedModel(nnx.Rngs(0))(x))
  model = jqf.quantize_model(ScannedModel(nnx.Rngs(0)), "fp8_current")
  want = x
  for i in range(LAYERS):
    want = ops.dense(want, model.layers.w[...][i], recipe="fp8_current")
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(want))
  bf16 = jqf.quantize_model(ScannedModel(nnx.Rngs(0)), "bf16")
  np.testing.assert_array_equal(np.asarray(bf16(x)), plain)


def test_concurrent_calls_of_one_model():
  x = inputs()
  model = jqf.quantize_model(Model(nnx.Rngs(0)), "fp8_current")
  fp8 = expected(model, x, "fp8_current")
  results, errors = [], []

  def call():
    try:
      for _ in range(2):
        results.append(np.asarray(model(x)))
    except Exception as e:  # reported below, with the others' results
      errors.append(e)

  threads = [threading.Thread(target=call) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert len(results) == 4
  for y in results:
    np.testing.assert_array_equal(y, fp8)
  assert "jaxquant_session" not in vars(model.block.own)


def test_closing_jax_jit_meets_nnx_own_error():
  """`nnx.jit` inside a `jax.jit` closing over the model cannot update the modules (they
  belong to the outer trace): NNX's error reaches the caller, as for the plain model."""
  model = jqf.quantize_model(Model(nnx.Rngs(0)), "fp8_current")
  with pytest.raises(TraceContextError, match="different trace level"):
    jax.jit(lambda x: model(x))(inputs())

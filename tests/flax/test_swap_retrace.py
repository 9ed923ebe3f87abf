"""The swap-in under Flax's lifted `nn.jit`: a model whose `__call__` (or a submodule's
class) is wrapped in `nn.jit`, as Gemma's is, follows the recipe of every call.

`nn.jit` caches its trace per transformed method, keyed by the module's fields, its
scope and the argument shapes; the routed contractions and the swap-in's rows exist
only while a trace runs. A recipe change must re-trace, and so must a second call of
the same quantized model (its report and no-GEMM check read that trace's rows).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant.flax as jqf


class OwnEinsum(nn.Module):
  """A model's own GEMM layer: a param and `jnp.einsum` (Gemma's `layers.Einsum`)."""

  shape: tuple

  @nn.compact
  def __call__(self, eqn, x):
    w = self.param("w", nn.initializers.normal(0.05), self.shape)
    return jnp.einsum(eqn, x, w)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(128, name="up")(x))
    h = OwnEinsum((128, 64), name="down")("btf,fd->btd", h)
    q = nn.Einsum((64, 2, 32), "btd,dnh->btnh", use_bias=False, name="q")(x)
    return x + h + q.reshape(x.shape)


class GemmaStyle(nn.Module):
  """`__call__` under `nn.jit`, and one block a class transformed by `nn.jit`."""

  @nn.jit
  @nn.compact
  def __call__(self, x):
    x = Block(name="block_0")(x)
    return nn.jit(Block)(name="block_1")(x)


WEIGHT_GEMMS = 6  # up, down, q in each of two blocks


@pytest.fixture(autouse=True)
def fresh_caches():
  jax.clear_caches()  # every test starts from no cached trace, so it needs no order


@pytest.fixture(scope="module")
def setup():
  x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.float32)
  variables = GemmaStyle().init(jax.random.key(0), x)
  return variables, x


def _apply(model, recipe, variables, x):
  return np.asarray(jqf.quantize_model(model, recipe).apply(variables, x))


def test_bf16_after_mxfp8_is_the_plain_model(setup):
  variables, x = setup
  model = GemmaStyle()
  plain = np.asarray(model.apply(variables, x))
  mx = _apply(model, "mxfp8", variables, x)
  assert not np.array_equal(mx, plain)
  np.testing.assert_array_equal(_apply(model, "bf16", variables, x), plain)
  # The plain model after both: its own trace, not a quantized one.
  np.testing.assert_array_equal(np.asarray(model.apply(variables, x)), plain)


def test_quantized_model_applied_twice(setup):
  variables, x = setup
  quantized = jqf.quantize_model(GemmaStyle(), "mxfp8")
  first = np.asarray(quantized.apply(variables, x))
  second = np.asarray(quantized.apply(variables, x))
  np.testing.assert_array_equal(first, second)
  for _ in range(2):
    report = jqf.swap_report(quantized, variables, x)
    assert len(report.quantized) == WEIGHT_GEMMS, str(report)


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_second_recipe_gives_its_own_numbers(setup):
  variables, x = setup
  expected = _apply(GemmaStyle(), "fp8_current", variables, x)
  jax.clear_caches()
  _apply(GemmaStyle(), "mxfp8", variables, x)
  np.testing.assert_array_equal(_apply(GemmaStyle(), "fp8_current", variables, x), expected)


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_init_of_a_quantized_model_after_the_plain_one():
  """At init the model runs as written, then quantized: the second run is traced anew."""
  x = jnp.ones((2, 32, 64), jnp.float32)
  GemmaStyle().init(jax.random.key(0), x)
  variables = jqf.quantize_model(GemmaStyle(), "mxfp8").init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, variables) == jax.tree.map(
    jnp.shape, GemmaStyle().init(jax.random.key(0), x)
  )


def test_user_jit_of_each_model(setup):
  """A user's `jax.jit` of a function applying a quantized model is that function's own
  trace: a jit of the plain model and one of the quantized model are two functions."""
  variables, x = setup
  model = GemmaStyle()
  plain = jax.jit(lambda v, x: model.apply(v, x))(variables, x)
  quantized = jqf.quantize_model(model, "mxfp8")
  mx = jax.jit(lambda v, x: quantized.apply(v, x))(variables, x)
  assert not np.array_equal(np.asarray(mx), np.asarray(plain))
  np.testing.assert_array_equal(mx, _apply(model, "mxfp8", variables, x))


class Holder(nn.Module):
  """A submodule passed as an attribute: bound before the wrapper's call begins."""

  block: nn.Module

  def __call__(self, x):
    return self.block(x)


def test_nn_jit_submodule_passed_as_attribute(setup):
  _, x = setup
  make = lambda: Holder(block=nn.jit(Block)())
  variables = make().init(jax.random.key(0), x)
  plain = np.asarray(make().apply(variables, x))
  quantized = jqf.quantize_model(make(), "mxfp8")
  mx = np.asarray(quantized.apply(variables, x))
  assert not np.array_equal(mx, plain)
  np.testing.assert_array_equal(np.asarray(quantized.apply(variables, x)), mx)
  np.testing.assert_array_equal(_apply(make(), "bf16", variables, x), plain)

"""jaxquant through Flax's dot_general hooks and MaxText's quantization protocol: the
numbers of the swap-in, the roles of the calling layer's path."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
import jaxquant.flax.nnx as jqnnx
from jaxquant import recipes

X = jax.random.normal(jax.random.key(1), (32, 64), jnp.bfloat16)


def forward_and_grads(apply, params):
  loss = lambda p: jnp.sum(apply(p).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss))(params)


class Proj(nn.Module):
  hook: object = None

  @nn.compact
  def __call__(self, x):
    return nn.Dense(64, dtype=jnp.bfloat16, dot_general_cls=self.hook, name="proj")(x)


class MoeLikeEinsum(nn.Module):
  """MaxText's MoE style: the weight contracted through `quant.einsum()`."""

  quant: object = None

  @nn.compact
  def __call__(self, x):
    kernel = self.param("wi", nn.initializers.normal(0.05), (64, 128))
    einsum = jnp.einsum if self.quant is None else self.quant.einsum(jnp.bfloat16)
    return einsum("td,df->tf", x, jnp.asarray(kernel, jnp.bfloat16))


@pytest.mark.slow  # over 20 s: run under the newest JAX only
def test_linen_dot_general_cls_is_the_swap_in():
  seen = []
  recipe = recipes.CustomRecipe(lambda r: seen.append(r.name) or recipes.fp8_current_factory(r))
  params = Proj().init(jax.random.key(0), X)["params"]
  hooked = forward_and_grads(
    lambda p: Proj(jqf.dot_general_cls(recipe)).apply({"params": p}, X), params
  )
  swapped = forward_and_grads(
    lambda p: jqf.quantize_model(Proj(), recipes.fp8_current).apply({"params": p}, X), params
  )
  jax.tree.map(np.testing.assert_array_equal, hooked, swapped)
  assert set(seen) == {"proj"}
  plain = forward_and_grads(lambda p: Proj().apply({"params": p}, X), params)
  bf16 = forward_and_grads(
    lambda p: Proj(jqf.dot_general_cls(recipes.bf16)).apply({"params": p}, X), params
  )
  jax.tree.map(np.testing.assert_array_equal, bf16, plain)


@pytest.mark.slow  # over 20 s: run under the newest JAX only
def test_maxtext_einsum_is_the_swap_in():
  params = MoeLikeEinsum().init(jax.random.key(0), X)["params"]
  quant = jqf.MaxTextQuantization(recipes.mxfp8)
  hooked = forward_and_grads(lambda p: MoeLikeEinsum(quant).apply({"params": p}, X), params)
  swapped = forward_and_grads(
    lambda p: jqf.quantize_model(MoeLikeEinsum(), recipes.mxfp8).apply({"params": p}, X), params
  )
  jax.tree.map(np.testing.assert_array_equal, hooked, swapped)


def test_nnx_hooks_are_jaxquant_layers():
  native = jqnnx.Linear(
    64, 64, use_bias=False, recipe=recipes.fp8_current, name="proj", rngs=nnx.Rngs(0)
  )
  hooked = nnx.Linear(
    64,
    64,
    use_bias=False,
    rngs=nnx.Rngs(0),
    dot_general=jqf.dot_general("proj", recipes.fp8_current),
  )
  einsum = nnx.Einsum(
    "td,df->tf",
    (64, 64),
    rngs=nnx.Rngs(0),
    bias_shape=None,
    einsum_op=jqf.einsum_op("proj", recipes.fp8_current),
  )
  einsum.kernel.set_value(native.kernel.get_value())

  def value_and_grad(layer):
    return nnx.jit(nnx.value_and_grad(lambda m: jnp.sum(m(X).astype(jnp.float32) ** 2)))(layer)

  (expected, expected_grads) = value_and_grad(native)
  for layer in (hooked, einsum):
    value, grads = value_and_grad(layer)
    assert value == expected
    np.testing.assert_array_equal(grads.kernel.get_value(), expected_grads.kernel.get_value())

"""GroupedDense (Linen, NNX) and the MoE block."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes
from jaxquant.flax import GroupedDense, MoE, NnxGroupedDense, weight_roles
from jaxquant.flax._moe import permute, route, unpermute
from jaxquant.quantizers import Float8Quantizer

SIZES = jnp.array([3, 0, 5], jnp.int32)


def test_linen_grouped_dense_one_param_with_role():
  x = jnp.ones((8, 16), jnp.float32)
  m = GroupedDense(3, 4, use_bias=True)
  # Jitted: one program each, not the grouped GEMM op by op.
  variables = jax.jit(m.init)(jax.random.key(0), x, SIZES)
  roles = weight_roles(variables)
  ((path, (role, _)),) = roles.items()
  assert path.endswith("kernel") and role.module_type == "grouped_linear"
  y = jax.jit(m.apply)(variables, x, SIZES)
  assert y.shape == (8, 4)


def test_nnx_grouped_dense_matches_linen_math():
  m = NnxGroupedDense(16, 4, 3, name="experts", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 16))
  y = m(x, SIZES)
  k = np.asarray(m.kernel[...])
  ref = np.concatenate([np.asarray(x[:3]) @ k[0], np.asarray(x[3:8]) @ k[2]])
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  assert list(weight_roles(m).values())[0][0].name == "experts"


def test_permute_unpermute_is_a_weighted_identity():
  x = jax.random.normal(jax.random.key(0), (6, 4))
  experts, weights, aux = route(jax.random.normal(jax.random.key(1), (6, 3)), 2)
  xs, order, sizes = permute(x, experts, 3)
  assert int(sizes.sum()) == 12 and aux > 0
  np.testing.assert_allclose(unpermute(xs, order, weights), x, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_moe_trains():
  # bf16 keeps this fast; quantized recipes run the same grouped_dense (tests/ops), but
  # three of them cost minutes of CPU tracing and compiling.
  moe = MoE(num_experts=4, hidden=32, top_k=2, recipe=recipes.bf16)
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  params = nn.unbox(moe.init(jax.random.key(1), x)["params"])

  @jax.jit
  def loss(p):
    y, aux = moe.apply({"params": p}, x)
    return jnp.mean(y**2) + 0.01 * aux

  val, grads = jax.value_and_grad(loss)(params)
  assert np.isfinite(val)
  assert grads["up"]["kernel"].shape == (4, 16, 32)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_quantize_model_gives_grouped_dense_the_model_recipe():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(16, name="proj")(x)
      return GroupedDense(3, 4, name="experts")(x, SIZES) + GroupedDense(
        3, 4, name="own", recipe=recipes.bf16
      )(x, SIZES)

  seen = []
  recording = recipes.CustomRecipe(lambda role: seen.append(role))
  x = jnp.ones((8, 16))
  jax.eval_shape(jqf.quantize_model(Model(), recording).init, jax.random.key(0), x)
  assert {(r.module_type, r.name) for r in seen} == {
    ("linear", "proj"),
    ("grouped_linear", "experts"),
  }
  boxed = jax.eval_shape(
    jqf.quantize_model(Model(), recipes.fp8_current).init, jax.random.key(0), x
  )["params"]
  quantizers = {path: q for path, (_, q) in weight_roles(boxed).items()}
  assert quantizers == {"experts/kernel": Float8Quantizer("e4m3"), "own/kernel": None}


@pytest.mark.slow
def test_nnx_quantize_model_binds_grouped_dense_to_path_and_recipe():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.experts = NnxGroupedDense(16, 4, 3, rngs=rngs)

  model = jqf.quantize_model(Model(nnx.Rngs(0)), recipes.fp8_current)
  ((path, (role, quantizer)),) = weight_roles(model).items()
  assert path == "experts/kernel" and role.name == "experts"
  assert quantizer == Float8Quantizer("e4m3")
  y = model.experts(jax.random.normal(jax.random.key(1), (8, 16)), SIZES)
  assert y.shape == (8, 4) and np.isfinite(np.asarray(y)).all()

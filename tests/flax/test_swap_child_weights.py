"""A module that contracts its child's param itself, the child's method having returned
it (gemma 4's MoE: `_Weight` modules that only return their param, the experts' ragged
dot made by the parent): the weight GEMM is the child's param's, quantized as if the
parent held it, its role the param's path."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxquant.flax as jqf
from jaxquant import recipes

X = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)
SIZES = jnp.array([16, 16, 16, 16], jnp.int32)


class Weight(nn.Module):
  shape: tuple

  @nn.compact
  def __call__(self):
    return self.param("w", nn.initializers.normal(), self.shape)


class ChildHeld(nn.Module):
  @nn.compact
  def __call__(self, x, sizes):
    dense = jnp.einsum("bd,df->bf", x, Weight((64, 64), name="proj")())
    experts = jnp.transpose(Weight((4, 2, 32, 64), name="experts")(), (0, 3, 1, 2))
    return dense, jax.lax.ragged_dot(x, experts.reshape(4, 64, 64), group_sizes=sizes)


class SelfHeld(nn.Module):
  """The same contractions of the same values, the params the module's own."""

  @nn.compact
  def __call__(self, x, sizes):
    dense = jnp.einsum("bd,df->bf", x, self.param("proj", nn.initializers.normal(), (64, 64)))
    experts = self.param("experts", nn.initializers.normal(), (4, 2, 32, 64))
    experts = jnp.transpose(experts, (0, 3, 1, 2)).reshape(4, 64, 64)
    return dense, jax.lax.ragged_dot(x, experts, group_sizes=sizes)


def test_a_childs_param_contracted_by_its_parent_is_its_weight_gemm():
  model = jqf.quantize_model(ChildHeld(), recipes.fp8_current)
  variables = jax.jit(model.init)(jax.random.key(0), X, SIZES)
  report = jqf.swap_report(model, variables, X, SIZES)
  assert sorted((r.role, r.status) for r in report.rows) == [
    ("experts/w", "quantized"),
    ("proj/w", "quantized"),
  ]
  params = variables["params"]
  own = {"params": {"proj": params["proj"]["w"], "experts": params["experts"]["w"]}}
  want = jax.jit(jqf.quantize_model(SelfHeld(), recipes.fp8_current).apply)(own, X, SIZES)
  got = jax.jit(model.apply)(variables, X, SIZES)
  for g, w, plain in zip(got, want, ChildHeld().apply(variables, X, SIZES), strict=True):
    np.testing.assert_array_equal(g, w)
    assert not np.array_equal(g, plain)  # quantized

"""A quantized function's state: delayed scaling's states as an explicit pytree (made by
`init`, read and written by `apply`, advanced by `update_quant_state`, checkpointed by
orbax), stochastic rounding's keys from `rng`, and the errors that say how to give them."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxquant
from jaxquant import NVFP4Quantizer, recipes
from jaxquant import functional as jqfn


def mlp(params, x):
  return jax.nn.gelu(x @ params["w_in"]) @ params["w_out"]


@pytest.fixture(scope="module")
def params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w_in": jax.random.normal(k1, (64, 128)) / 8,
    "w_out": jax.random.normal(k2, (128, 64)) / 11,
  }


def inputs(seed=1):
  return jax.random.normal(jax.random.key(seed), (32, 64))


def advanced_state(qfn, params):
  """The state after two steps, its scales moved off the initial ones."""
  state = qfn.init(params, inputs())

  @jax.jit
  def step(state, x):
    def loss(params, state):
      out, new_state = qfn.apply(params, x, state=state)
      return jnp.sum(out**2), new_state

    (_, new_state), (_, state_grads) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      params, state
    )
    return jqfn.update_quant_state(new_state, state_grads)

  for seed in (1, 2):
    state = step(state, inputs(seed))
  return state


def test_delayed_state_round_trips_through_orbax(params, tmp_path):
  qfn = jaxquant.quantize(mlp, "fp8_delayed")
  state = advanced_state(qfn, params)
  assert sorted(state) == ["w_in", "w_out"]
  assert sorted(state["w_in"]) == ["grad_output", "input", "weight"]
  assert float(state["w_out"]["grad_output"].scaling.scale) != 1.0
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  target = jax.eval_shape(lambda: qfn.init(params, inputs()))
  restored = checkpointer.restore(tmp_path / "state", target)
  assert jax.tree.structure(restored, is_leaf=jqfn.RoleState.__instancecheck__) == (
    jax.tree.structure(state, is_leaf=jqfn.RoleState.__instancecheck__)
  )
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  apply = jax.jit(lambda s: qfn.apply(params, inputs(3), state=s))
  jax.tree.map(np.testing.assert_array_equal, apply(restored), apply(state))
  untyped = checkpointer.restore(tmp_path / "state")
  with pytest.raises(TypeError, match=r"not a jaxquant RoleState.*qfn.init as the target"):
    qfn.apply(params, inputs(), state=untyped)
  with pytest.raises(TypeError, match="restored without a target"):
    jqfn.update_quant_state(untyped)


def test_a_plain_call_refuses_delayed_scaling(params):
  with pytest.raises(ValueError, match=r"delayed scaling.*state = qfn.init\(\*args\)"):
    jaxquant.quantize(mlp, "fp8_delayed")(params, inputs())


def test_apply_needs_the_state_of_the_recipe(params):
  qfn = jaxquant.quantize(mlp, "fp8_delayed")
  with pytest.raises(ValueError, match="the state holds none for role 'w_in'"):
    qfn.apply(params, inputs(), state={})
  w_out_only = lambda role: recipes.fp8_delayed_factory(role) if role.name == "w_out" else None
  other = jaxquant.quantize(mlp, recipes.CustomRecipe(w_out_only))
  state = other.init(params, inputs())
  assert sorted(state) == ["w_out"]  # only the role the policy gives delayed scaling
  with pytest.raises(ValueError, match="holds none for role 'w_in'"):
    qfn.apply(params, inputs(), state=state)


def test_stochastic_rounding_draws_from_rng(params):
  # Rounds stochastically in the backward only (nvfp4's grad_output): the forward needs no key.
  policy = lambda role: NVFP4Quantizer(stochastic_rounding=role.tensor_type == "grad_output")
  qfn = jaxquant.quantize(mlp, recipes.CustomRecipe(policy))
  x = inputs()
  jax.eval_shape(qfn, params, x)
  grads = jax.jit(jax.grad(lambda p, key: jnp.sum(qfn.apply(p, x, state={}, rng=key)[0] ** 2)))
  first, again, other = (grads(params, jax.random.key(k)) for k in (5, 5, 6))
  jax.tree.map(np.testing.assert_array_equal, first, again)
  assert not np.array_equal(first["w_in"], other["w_in"])
  with pytest.raises(ValueError, match="rounds stochastically"):
    jax.eval_shape(jax.grad(lambda p: jnp.sum(qfn(p, x) ** 2)), params)

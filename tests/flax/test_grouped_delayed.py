"""Delayed scaling (the fp8_delayed preset) in jaxquant's grouped layers: `GroupedDense`
(Linen), `NnxGroupedDense` and the `MoE` block keep one state per expert where a dense
layer keeps its one, made at init, advanced per expert by `update_quant_state`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import ops, recipes
from jaxquant.flax import GroupedDense, MoE, NnxGroupedDense
from jaxquant.ops._grouped_dense import init_grouped_state, update_grouped_state

D, EXPERTS = 32, 3
SIZES = jnp.array([5, 3, 8], jnp.int32)  # every expert gets rows: each one's scales move
X = jax.random.normal(jax.random.key(0), (16, D))
TARGET = jax.random.normal(jax.random.key(1), (16, D))


def assert_advanced(state, groups):
  """Each group's scale moved off its initial 1 and its amax history holds records."""
  assert state.scaling.scale.shape == groups, state.role
  assert np.all(np.isfinite(state.scaling.scale)), state.role
  assert np.all(state.scaling.scale != 1), state.role
  assert np.all(np.any(state.scaling.amax_history != 0, axis=-1)), state.role


def role_states(tree):
  leaves = jax.tree.leaves(tree, is_leaf=jqf.is_role_state)
  return [leaf for leaf in leaves if jqf.is_role_state(leaf)]


def linen_step(model, inputs, loss_of):
  """The README's Linen train step: grads of the params and of the collections, the
  state advanced once."""

  @jax.jit
  def step(params, collections):
    def loss_fn(params, collections):
      out, updated = model.apply(
        {"params": params, **collections}, *inputs, mutable=list(collections)
      )
      return loss_of(out), updated

    (value, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, collections)
    params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return value, params, jqf.update_quant_state(updated, state_grads)

  return step


def test_linen_grouped_dense_advances_a_state_per_expert_as_ops_grouped_dense_does():
  layer = GroupedDense(EXPERTS, D, recipe="fp8_delayed")  # a root layer: roles "kernel"
  variables = jax.jit(layer.init)(jax.random.key(2), X, SIZES)
  collections = dict(variables)
  params = collections.pop("params")
  assert set(collections["quant_state"]) == {"input", "weight", "grad_output"}
  loss_of = lambda y: jnp.mean((y - TARGET) ** 2)
  step = linen_step(layer, (X, SIZES), loss_of)
  _, _, after = step(params, collections)

  # The same step through the functional op and its own state update.
  quantizers = recipes.fp8_delayed.quantizers("grouped_linear", "kernel")
  state = init_grouped_state(quantizers, EXPERTS)
  kernel = nn.unbox(params)["kernel"]

  def loss(state):
    y, new_state = ops.grouped_dense(X, kernel, SIZES, quantizers=quantizers, state=state)
    return loss_of(y), new_state

  (_, forward), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  expected = update_grouped_state(forward, quantizers, grads)
  for t, held in after["quant_state"].items():
    assert held.role.module_type == "grouped_linear" and held.role.name == "kernel"
    assert_advanced(held, (EXPERTS,))
    np.testing.assert_array_equal(held.scaling.scale, expected[t].scale)
    np.testing.assert_array_equal(held.scaling.amax_history, expected[t].amax_history)


def test_linen_moe_trains_under_fp8_delayed_with_its_experts_scales_advancing():
  moe = MoE(num_experts=4, hidden=D, top_k=2, recipe=recipes.fp8_delayed)
  x = jax.random.normal(jax.random.key(3), (2, 8, D))
  variables = jax.jit(moe.init)(jax.random.key(4), x)
  collections = {"quant_state": variables["quant_state"]}
  params = variables["params"]
  states = role_states(collections)
  assert {s.role.name for s in states} == {"gate", "up", "down"} and len(states) == 9
  step = linen_step(moe, (x,), lambda out: jnp.mean((out[0] - x) ** 2) + 0.01 * out[1])
  losses = []
  for _ in range(3):
    value, params, collections = step(params, collections)
    losses.append(float(value))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  logits = x.reshape(-1, D) @ nn.unbox(params)["router"]["kernel"]
  routed = np.bincount(np.asarray(jax.lax.top_k(logits, 2)[1]).ravel(), minlength=4)
  assert np.all(routed > 0)  # so every expert's scales can move
  for state in role_states(collections):
    assert_advanced(state, (4,))


def test_grouped_layers_under_bf16_are_the_plain_layers_bit_for_bit():
  moe = lambda recipe: MoE(num_experts=4, hidden=D, top_k=2, recipe=recipe)
  x = jax.random.normal(jax.random.key(3), (2, 8, D))
  variables = jax.jit(moe(None).init)(jax.random.key(4), x)

  def value_and_grads(recipe):
    loss = lambda p: jnp.mean(moe(recipe).apply({"params": p}, x)[0] ** 2)
    return jax.jit(jax.value_and_grad(loss))(variables["params"])

  assert "quant_state" not in jax.eval_shape(moe("bf16").init, jax.random.key(4), x)
  for a, b in zip(
    jax.tree.leaves(value_and_grads(None)), jax.tree.leaves(value_and_grads("bf16")), strict=True
  ):
    np.testing.assert_array_equal(a, b)


class NnxExperts(nnx.Module):
  def __init__(self, *, rngs):
    self.up = NnxGroupedDense(D, D, EXPERTS, rngs=rngs)
    self.down = NnxGroupedDense(D, D, EXPERTS, rngs=rngs)

  def __call__(self, x, sizes):
    return self.down(jax.nn.gelu(self.up(x, sizes)), sizes)


def test_nnx_grouped_dense_trains_under_fp8_delayed_with_a_state_per_expert():
  model = jqf.quantize_model(NnxExperts(rngs=nnx.Rngs(0)), recipes.fp8_delayed)
  initial = role_states(nnx.state(model, jqf.QuantState))
  assert {(s.role.name, s.role.tensor_type) for s in initial} == {
    (name, t) for name in ("up", "down") for t in ("input", "weight", "grad_output")
  }
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss_fn = lambda model: jnp.mean((model(X, SIZES) - TARGET) ** 2)
    diff = nnx.DiffState(0, (nnx.Param, jqf.QuantState))
    value, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
    optimizer.update(model, nnx.filter_state(grads, nnx.Param))
    jqf.update_quant_state(model, grads)
    return value

  losses = [float(step(model, optimizer)) for _ in range(3)]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  for state in role_states(nnx.state(model, jqf.QuantState)):
    assert_advanced(state, (EXPERTS,))
  # A recipe without delayed scaling takes the states away.
  jqf.quantize_model(model, recipes.fp8_current)
  assert not role_states(nnx.state(model, jqf.QuantState))


def test_grouped_dense_holds_no_state_where_its_gemm_stays_in_high_precision():
  # Delayed FP8 forward, MXFP8 gradients: a kernel whose N is under one block (32) is tiny.
  delayed_forward = recipes.CustomRecipe(
    lambda role: (
      recipes.mxfp8_factory(role)
      if role.tensor_type == "grad_output"
      else recipes.fp8_delayed_factory(role)
    ),
    tiny_gemms_in_high_precision=True,
  )
  big = NnxGroupedDense(D, D, EXPERTS, name="big", recipe=delayed_forward, rngs=nnx.Rngs(0))
  tiny = NnxGroupedDense(D, 4, EXPERTS, name="tiny", recipe=delayed_forward, rngs=nnx.Rngs(0))
  assert {s.role.tensor_type for s in role_states(nnx.state(big, jqf.QuantState))} == {
    "input",
    "weight",
  }
  assert not role_states(nnx.state(tiny, jqf.QuantState))
  np.testing.assert_array_equal(
    tiny(X, SIZES), ops.grouped_dense(X, tiny.kernel[...], SIZES, recipe="bf16")
  )
  linen = GroupedDense(EXPERTS, 4, recipe=delayed_forward)
  assert "quant_state" not in jax.eval_shape(linen.init, jax.random.key(0), X, SIZES)

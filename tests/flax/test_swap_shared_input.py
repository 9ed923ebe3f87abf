"""Delayed scaling's input state, shared by the layers that read one tensor: under the
swap-in, q, k and v quantize their common input with q's state (the first to read it),
each writes that tensor's amax into its own state, and a layer that reads another tensor,
or the same tensor in another trace, keeps its own. Stock Linen and NNX layers and a
model's own einsum layers (routed) alike."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import ops, recipes

TOKENS, D = 64, 128


class Attention(nn.Module):
  """q, k and v read x; o reads their combination. `remat_k` runs k in a trace of its
  own (nn.remat), where x is another traced value."""

  remat_k: bool = False

  @nn.compact
  def __call__(self, x):
    dense = lambda name, cls=nn.Dense: cls(D, use_bias=False, name=name)
    q = dense("q")(x)
    k = dense("k", nn.remat(nn.Dense) if self.remat_k else nn.Dense)(x)
    v = dense("v")(x)
    return q, k, v, dense("o")(q * k + v)


class OwnEinsum(nn.Module):
  """A model's own GEMM layer (gemma style), which the swap-in routes."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (D, D))
    return jnp.einsum("btd,df->btf", x, w)


class RoutedPair(nn.Module):
  @nn.compact
  def __call__(self, x):
    return OwnEinsum(name="q")(x), OwnEinsum(name="k")(x)


class NnxAttention(nnx.Module):
  def __init__(self, rngs):
    for name in "qkvo":
      setattr(self, name, nnx.Linear(D, D, use_bias=False, rngs=rngs))

  def __call__(self, x):
    q, k, v = self.q(x), self.k(x), self.v(x)
    return q, k, v, self.o(q * k + v)


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (2, TOKENS // 2, D), jnp.bfloat16) * 3


def _with_input_scale(collections, layer, scale):
  """The collections with `layer`'s input state holding `scale` (its history as is)."""
  state = collections["quant_state"][layer]["input"]
  changed = dataclasses.replace(
    state, scaling=dataclasses.replace(state.scaling, scale=jnp.float32(scale))
  )
  quant_state = {**collections["quant_state"], layer: {**collections["quant_state"][layer]}}
  quant_state[layer]["input"] = changed
  return {**collections, "quant_state": quant_state}


def _dense(x, kernel, states):
  """The oracle: ops.dense of x with these delayed-scaling states, in fp32 (the layers
  promote a bf16 x to their fp32 kernel's dtype)."""
  y, _ = ops.dense(
    x.reshape(-1, D).astype(jnp.float32), kernel, recipe=recipes.fp8_delayed, state=states
  )
  return y.reshape(x.shape[:-1] + (D,))


def _own_state_output(params, collections, layer, x):
  """`layer`'s output quantized with its own states."""
  states = {t: s.scaling for t, s in collections["quant_state"][layer].items()}
  return _dense(x, params[layer]["kernel"], states)


def _linen(remat_k=False):
  model = jqf.quantize_model(Attention(remat_k=remat_k), recipes.fp8_delayed)
  variables = model.init(jax.random.key(1), _x())
  params, collections = variables["params"], {"quant_state": variables["quant_state"]}
  # A step first, so that every state holds a recorded amax and a scale of its own.
  _, updated = model.apply({"params": params, **collections}, _x(1), mutable=["quant_state"])
  return model, params, jqf.update_quant_state(updated)


def test_q_k_and_v_quantize_their_input_with_the_first_reader_state():
  model, params, collections = _linen()
  q_scale = float(collections["quant_state"]["q"]["input"].scaling.scale)
  collections = _with_input_scale(collections, "k", 4 * q_scale)
  x = _x(2)
  (q, k, v, _), updated = model.apply({"params": params, **collections}, x, mutable=["quant_state"])
  own_k = _own_state_output(params, collections, "k", x)
  q_state_k = _own_state_output(params, _with_input_scale(collections, "k", q_scale), "k", x)
  assert not np.array_equal(own_k, q_state_k)  # the two scales give other bits
  np.testing.assert_array_equal(k, q_state_k)
  np.testing.assert_array_equal(q, _own_state_output(params, collections, "q", x))
  np.testing.assert_array_equal(v, _own_state_output(params, collections, "v", x))
  # k's state was written from q's: they are equal again, the amax of x recorded in both.
  k_state, q_state = (updated["quant_state"][n]["input"].scaling for n in "kq")
  np.testing.assert_array_equal(k_state.scale, q_state.scale)
  np.testing.assert_array_equal(k_state.amax_history, q_state.amax_history)
  assert k_state.amax_history[0] == jnp.max(jnp.abs(x.astype(jnp.float32)))


def test_a_layer_reading_another_tensor_or_another_trace_keeps_its_own_state():
  model, params, collections = _linen(remat_k=True)
  q_scale = float(collections["quant_state"]["q"]["input"].scaling.scale)
  collections = _with_input_scale(collections, "k", 4 * q_scale)
  collections = _with_input_scale(collections, "o", 4 * q_scale)
  x = _x(2)
  (q, k, v, o), _ = model.apply({"params": params, **collections}, x, mutable=["quant_state"])
  np.testing.assert_array_equal(k, _own_state_output(params, collections, "k", x))
  np.testing.assert_array_equal(o, _own_state_output(params, collections, "o", q * k + v))


def test_routed_contractions_share_the_first_reader_state_too():
  model = jqf.quantize_model(RoutedPair(), recipes.fp8_delayed)
  variables = model.init(jax.random.key(1), _x())
  params, collections = variables["params"], {"quant_state": variables["quant_state"]}
  _, updated = model.apply({"params": params, **collections}, _x(1), mutable=["quant_state"])
  states = jqf.update_quant_state(updated)["quant_state"]
  q_input = states["q"]["w_input"]
  k_states = {**states["k"]}
  k_states["w_input"] = dataclasses.replace(
    k_states["w_input"],
    scaling=dataclasses.replace(q_input.scaling, scale=4 * q_input.scaling.scale),
  )
  x = _x(2)
  (_, k), _ = model.apply(
    {"params": params, "quant_state": {**states, "k": k_states}}, x, mutable=["quant_state"]
  )
  own = {t.removeprefix("w_"): s.scaling for t, s in k_states.items()}
  expected = _dense(x, params["k"]["w"], own | {"input": q_input.scaling})
  assert not np.array_equal(_dense(x, params["k"]["w"], own), expected)  # other bits
  np.testing.assert_array_equal(k, expected)


def test_nnx_layers_share_the_first_reader_state_too():
  model = jqf.quantize_model(NnxAttention(nnx.Rngs(0)), recipes.fp8_delayed)
  model(_x(1))  # a step: every state holds a recorded amax and a scale of its own
  jqf.update_quant_state(model)
  q_input = model.q.quant_state.get_value()["input"]
  k_states = dict(model.k.quant_state.get_value())
  k_states["input"] = dataclasses.replace(
    k_states["input"],
    scaling=dataclasses.replace(q_input.scaling, scale=4 * q_input.scaling.scale),
  )
  model.k.quant_state.set_value(k_states)
  x = _x(2)
  _, k, _, _ = model(x)
  own = {t: s.scaling for t, s in k_states.items()}
  expected = _dense(x, model.k.kernel[...], own | {"input": q_input.scaling})
  assert not np.array_equal(_dense(x, model.k.kernel[...], own), expected)  # other bits
  np.testing.assert_array_equal(k, expected)

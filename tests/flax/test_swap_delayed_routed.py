"""Delayed scaling (the fp8_delayed preset) on contractions the model's own code makes: a
state per weight GEMM, one per expert for a grouped one, made at the GEMM's first traced
call and advanced by `update_quant_state` like every layer's.

Models in their packages' styles: an NNX decoder whose head is contracted by its own
code (EasyDeL's `ParallelLinear`, MaxText's `logits_dense`), its blocks scanned too, a
Linen MoE whose experts
are `jax.lax.ragged_dot` over tokens sorted by expert (gemma 4's), and an NNX MoE that
dispatches tokens into padded expert slots and runs its experts as one batched einsum
('ecd,edf->ecf').
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxquant.flax as jqf
from jaxquant import recipes

VOCAB, D, F, EXPERTS, TOKENS = 64, 32, 64, 4, (2, 16)
TOKEN_DATA = jax.random.randint(jax.random.key(7), TOKENS, 0, VOCAB)


def cross_entropy(logits, tokens):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))


# ---- NNX: a head contracted by the model's own code ----


class ParallelLinear(nnx.Module):
  """EasyDeL's `ParallelLinear`: its own kernel, contracted with `lax.dot_general`."""

  def __init__(self, d_in, d_out, *, rngs):
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out)))

  def __call__(self, x):
    kernel = self.kernel[...].astype(x.dtype)
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class NnxDecoder(nnx.Module):
  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.up = nnx.Linear(D, F, dtype=jnp.bfloat16, rngs=rngs)
    self.down = nnx.Linear(F, D, dtype=jnp.bfloat16, rngs=rngs)
    self.lm_head = ParallelLinear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    x = x + self.down(jax.nn.gelu(self.up(x)))
    return self.lm_head(x)


class ScannedNnxDecoder(nnx.Module):
  """The same GEMMs, its blocks stacked by `nnx.vmap` and run by `nnx.scan` (EasyDeL's
  `scan_layers`): each block's routed GEMMs get a state per layer."""

  def __init__(self, *, rngs, layers=2):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(rngs=rngs)

    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = blocks(rngs)
    self.lm_head = ParallelLinear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(block, x):
      return block(x)

    return self.lm_head(run(self.blocks, self.embed(tokens).astype(jnp.bfloat16)))


class Block(nnx.Module):
  def __init__(self, *, rngs):
    self.up = ParallelLinear(D, F, rngs=rngs)
    self.down = ParallelLinear(F, D, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))


def nnx_train(model, steps, lr=0.05):
  """The README's NNX train step: grads of the params and the QuantState; the state
  advanced once per step. Returns the losses."""
  optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return cross_entropy(model(TOKEN_DATA), TOKEN_DATA)

    diff = nnx.DiffState(0, (nnx.Param, jqf.QuantState))
    value, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
    optimizer.update(model, nnx.filter_state(grads, nnx.Param))
    jqf.update_quant_state(model, grads)
    return value

  return [float(step(model, optimizer)) for _ in range(steps)]


def _states(tree):
  leaves = jax.tree.leaves(tree, is_leaf=jqf.is_role_state)
  return {leaf.role: leaf for leaf in leaves if jqf.is_role_state(leaf)}


def assert_advanced(state, groups=()):
  """Every scale of `state` moved off its initial 1 and its amax history holds records,
  for each group (`groups`: the leading axes of a grouped state)."""
  assert state.scaling.scale.shape == groups, state.role
  assert np.all(np.isfinite(state.scaling.scale)), state.role
  assert np.all(state.scaling.scale != 1), state.role
  assert np.all(np.any(state.scaling.amax_history != 0, axis=-1)), state.role


def test_nnx_scanned_routed_gemms_get_a_state_per_layer():
  model = jqf.quantize_model(ScannedNnxDecoder(rngs=nnx.Rngs(0)), recipes.fp8_delayed)
  losses = nnx_train(model, steps=2)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  states = _states(nnx.state(model.blocks, jqf.QuantState))
  assert {r.name for r in states} == {"blocks/up", "blocks/down"} and len(states) == 6
  for state in states.values():
    assert_advanced(state, groups=(2,))  # one per layer


def test_nnx_routed_head_trains_under_fp8_delayed_with_its_scales_advancing():
  model = jqf.quantize_model(NnxDecoder(rngs=nnx.Rngs(0)), recipes.fp8_delayed)
  assert not hasattr(model.lm_head, "kernel_quant_state")  # made at the first call
  losses = nnx_train(model, steps=3)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  head = _states(nnx.state(model.lm_head, jqf.QuantState))
  assert {r.name for r in head} == {"lm_head"}
  assert {r.tensor_type for r in head} == {"input", "weight", "grad_output"}
  for state in head.values():
    assert_advanced(state)
  # The swapped layers' states advance alike, as before.
  for state in _states(nnx.state(model.up, jqf.QuantState)).values():
    assert_advanced(state)


# ---- Linen: experts as ragged dots (gemma 4's MoE) ----


class RaggedMoE(nn.Module):
  """gemma 4's MoE block: a router kept as written (N = experts is tiny), top-k, tokens
  sorted by expert, the experts' [E, D, F] weights contracted by `jax.lax.ragged_dot`."""

  top_k: int = 2

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.normal(0.05)
    router = self.param("router", init, (D, EXPERTS))
    gating = self.param("gating_einsum", init, (EXPERTS, D, F))
    linear = self.param("linear", init, (EXPERTS, F, D))
    tokens = x.reshape(-1, D)
    weights, experts = jax.lax.top_k(jax.nn.softmax(tokens @ router), self.top_k)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.repeat(tokens, self.top_k, axis=0)[order].astype(jnp.bfloat16)
    sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    h = jax.nn.gelu(jax.lax.ragged_dot(rows, gating.astype(jnp.bfloat16), sizes))
    y = jax.lax.ragged_dot(h, linear.astype(jnp.bfloat16), sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(-1, self.top_k, D)
    return (y * weights[..., None].astype(y.dtype)).sum(1).reshape(x.shape)


class LinenMoELM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D, name="embed")(tokens)
    x = x + RaggedMoE(name="moe")(x)
    return x @ self.param("unembed", nn.initializers.normal(0.05), (D, VOCAB))


def linen_train(model, variables, steps, lr=0.05):
  """The README's Linen train step from `variables`. Returns (losses, the collections)."""
  collections = dict(variables)
  params = collections.pop("params")

  def loss_fn(params, collections):
    logits, updated = model.apply(
      {"params": params, **collections}, TOKEN_DATA, mutable=list(collections)
    )
    return cross_entropy(logits, TOKEN_DATA), updated

  @jax.jit
  def step(params, collections):
    (value, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, collections)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return value, params, jqf.update_quant_state(updated, state_grads)

  losses = []
  for _ in range(steps):
    value, params, collections = step(params, collections)
    losses.append(float(value))
  return losses, collections


def test_linen_ragged_dot_experts_train_under_fp8_delayed_with_a_state_per_expert():
  model = jqf.quantize_model(LinenMoELM(), recipes.fp8_delayed)
  variables = jax.jit(model.init)(jax.random.key(0), TOKEN_DATA)
  initial = _states(variables["quant_state"])
  experts = {r: s for r, s in initial.items() if r.module_type == "grouped_linear"}
  assert {r.name for r in experts} == {"moe/gating_einsum", "moe/linear"}
  assert all(s.scaling.amax_history.shape[0] == EXPERTS for s in experts.values())
  losses, collections = linen_train(model, variables, steps=2)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  states = _states(collections["quant_state"])
  assert len(states) == len(initial)
  for role in experts:  # every expert is routed tokens here: each one's scales move
    assert_advanced(states[role], groups=(EXPERTS,))
  assert_advanced(states[next(r for r in states if r.name == "unembed")])


# ---- NNX: experts as one batched einsum over padded expert slots ----


class PaddedDispatchMoE(nnx.Module):
  """Tokens dispatched into [E, C, D] expert slots by a one-hot einsum (capacity C, the
  overflow dropped), each expert's [D, F] weights applied by one batched einsum, combined
  back by the router's weights."""

  def __init__(self, capacity, *, rngs):
    init = nnx.initializers.normal(0.05)
    self.router = nnx.Param(init(rngs.params(), (D, EXPERTS)))
    self.wi = nnx.Param(init(rngs.params(), (EXPERTS, D, F)))
    self.wo = nnx.Param(init(rngs.params(), (EXPERTS, F, D)))
    self.capacity = capacity

  def __call__(self, x):
    tokens = x.reshape(-1, D)
    probs = jax.nn.softmax(tokens.astype(jnp.float32) @ self.router[...])
    expert = jnp.argmax(probs, -1)
    onehot = jax.nn.one_hot(expert, EXPERTS, dtype=jnp.int32)
    slot = jnp.sum(jnp.cumsum(onehot, 0) * onehot, -1) - 1  # the token's place at its expert
    in_slot = jax.nn.one_hot(slot, self.capacity, dtype=jnp.int32)
    dispatch = (onehot[..., None] * in_slot[:, None, :]).astype(x.dtype)
    slots = jnp.einsum("sec,sd->ecd", dispatch, tokens)
    h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", slots, self.wi[...].astype(x.dtype)))
    out = jnp.einsum("ecf,efd->ecd", h, self.wo[...].astype(x.dtype))
    combine = dispatch * jnp.max(probs, -1)[:, None, None].astype(x.dtype)
    return jnp.einsum("sec,ecd->sd", combine, out).reshape(x.shape)


class NnxMoELM(nnx.Module):
  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.moe = PaddedDispatchMoE(capacity=16, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    return self.head(x + self.moe(x))


def test_nnx_batched_einsum_experts_train_under_fp8_delayed_with_a_state_per_expert():
  model = jqf.quantize_model(NnxMoELM(rngs=nnx.Rngs(0)), recipes.fp8_delayed)
  report = jqf.swap_report(model, TOKEN_DATA)
  assert {r.role for r in report.quantized} == {"moe/router", "moe/wi", "moe/wo", "head"}
  losses = nnx_train(model, steps=3)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  experts = _states(nnx.state(model.moe, jqf.QuantState))
  grouped = {r: s for r, s in experts.items() if r.module_type == "grouped_linear"}
  assert {r.name for r in grouped} == {"moe/wi", "moe/wo"} and len(grouped) == 6
  tokens_per_expert = np.bincount(
    np.argmax(np.asarray(model.embed(TOKEN_DATA).reshape(-1, D) @ model.moe.router[...]), -1),
    minlength=EXPERTS,
  )
  assert np.all(tokens_per_expert > 0)  # so every expert's scales can move
  for state in grouped.values():
    assert_advanced(state, groups=(EXPERTS,))

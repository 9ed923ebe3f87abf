"""A nested `Module.apply` inside a quantized Linen model: transformers' FlaxGPT2LMHeadModel
ties its head to the token embedding with `self.lm_head.apply({"params": {"kernel":
wte.T}}, hidden)`. The head's GEMM is the model's: its role is the embedding's path, its
delayed-scaling state lives in the model's collection, its stochastic-rounding keys come
from the model's "quant" stream; untied, the head is a layer like any other."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant.flax as jqf
from jaxquant import recipes

VOCAB, D, TOKENS = 64, 32, (2, 16)
TOKEN_DATA = jax.random.randint(jax.random.key(5), TOKENS, 0, VOCAB)
TIED_ROLE = "transformer/wte/embedding"


class GPT2Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    inner = nn.Dense(4 * D, dtype=jnp.bfloat16, name="c_fc")(nn.LayerNorm(name="ln_2")(h))
    return h + nn.Dense(D, dtype=jnp.bfloat16, name="c_proj")(nn.gelu(inner))


class GPT2Module(nn.Module):
  def setup(self):
    self.wte = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.05))
    self.h = GPT2Block()
    self.ln_f = nn.LayerNorm()

  def __call__(self, tokens):
    return self.ln_f(self.h(self.wte(tokens).astype(jnp.bfloat16)))


class GPT2LMHeadModule(nn.Module):
  """transformers' FlaxGPT2LMHeadModule, its head tied to `wte` (or not)."""

  tie_word_embeddings: bool = True

  def setup(self):
    self.transformer = GPT2Module()
    self.lm_head = nn.Dense(VOCAB, use_bias=False, dtype=jnp.bfloat16)

  def __call__(self, tokens):
    hidden = self.transformer(tokens)
    if self.tie_word_embeddings:
      shared_kernel = self.transformer.variables["params"]["wte"]["embedding"].T
      return self.lm_head.apply({"params": {"kernel": shared_kernel}}, hidden)
    return self.lm_head(hidden)


def loss_fn(model, params, collections, key):
  logits, updated = model.apply(
    {"params": params, **collections},
    TOKEN_DATA,
    rngs={"quant": key},
    mutable=list(collections),
  )
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, TOKEN_DATA[..., None], -1)), updated


def train(model, steps, lr=0.1):
  variables = dict(jax.jit(model.init)(jax.random.key(0), TOKEN_DATA))
  params = variables.pop("params")

  @jax.jit
  def step(params, collections, key):
    (value, updated), (grads, state_grads) = jax.value_and_grad(
      lambda p, c: loss_fn(model, p, c, key), argnums=(0, 1), has_aux=True
    )(params, collections)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return value, params, jqf.update_quant_state(updated, state_grads)

  losses = []
  for i in range(steps):
    value, params, variables = step(params, variables, jax.random.key(i))
    losses.append(float(value))
  return losses, params, variables


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_heads_role_is_named_by_its_params_path(tied):
  model = jqf.quantize_model(GPT2LMHeadModule(tied), recipes.fp8_current)
  variables = jax.jit(model.init)(jax.random.key(0), TOKEN_DATA)
  report = jqf.swap_report(model, variables, TOKEN_DATA)
  head = TIED_ROLE if tied else "lm_head"
  assert {r.role for r in report.quantized} == {"transformer/h/c_fc", "transformer/h/c_proj", head}
  assert "lm_head" not in variables["params"] if tied else "lm_head" in variables["params"]


def test_a_policy_for_the_tied_head_holds():
  policy = lambda role: None if role.name == TIED_ROLE else recipes.mxfp8_factory(role)
  model = jqf.quantize_model(GPT2LMHeadModule(), recipes.CustomRecipe(policy))
  variables = jax.jit(model.init)(jax.random.key(0), TOKEN_DATA)
  report = jqf.swap_report(model, variables, TOKEN_DATA)
  assert [r.role for r in report.high_precision if r.role] == [TIED_ROLE]


def test_fp8_delayed_trains_the_tied_head_with_its_scales_advancing():
  model = jqf.quantize_model(GPT2LMHeadModule(), recipes.fp8_delayed)
  losses, _, variables = train(model, steps=2)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  states = [
    leaf
    for leaf in jax.tree.leaves(variables["quant_state"], is_leaf=jqf.is_role_state)
    if jqf.is_role_state(leaf)
  ]
  head = [s for s in states if s.role.name == TIED_ROLE]
  assert {s.role.tensor_type for s in head} == {"input", "weight", "grad_output"}
  for state in head:
    assert np.all(state.scaling.scale != 1) and np.all(np.isfinite(state.scaling.scale))
    assert np.any(state.scaling.amax_history != 0)


def test_nvfp4_trains_the_tied_head_with_the_models_key():
  # Its gradient rounds stochastically: without a key reaching the nested apply's GEMM the
  # backward would raise (test_forward_without_key).
  model = jqf.quantize_model(GPT2LMHeadModule(), recipes.nvfp4)
  losses, _, _ = train(model, steps=2)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]

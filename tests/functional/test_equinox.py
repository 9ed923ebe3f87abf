"""Equinox models under `jaxquant.quantize`: written for one example and batched with
`jax.vmap`, their array leaves the params, run by `eqx.filter_jit` and differentiated by
`eqx.filter_value_and_grad`. An MLP of `eqx.nn.Linear` (every preset trains, NVFP4's
included; its Flax twin under the swap-in gives the same bits), a transformer block with
`eqx.nn.MultiheadAttention`, and a stack of blocks run by `lax.scan`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from function_models import BATCH, SEQ, D, EqxBlock, EqxMlp, EqxStack, FlaxMlp, flax_mlp_params
from function_training import assert_trains, train

import jaxquant
import jaxquant.flax as jqf
from jaxquant import functional as jqfn
from jaxquant import recipes

# 128 wide, 128 rows: every preset's blocks fit (fp8_block's weights are 128x128 tiles).
SIZES = (128, 128, 128)


def batched(model, x):
  return jax.vmap(model)(x)


def mse(out, batch):
  return jnp.mean(jnp.square(out - jnp.tanh(batch[..., ::-1])))


@pytest.fixture(scope="module")
def mlp():
  return EqxMlp(SIZES, jax.random.key(0))


@pytest.fixture(scope="module")
def rows():
  return jax.random.normal(jax.random.key(1), (128, SIZES[0]))


def test_bf16_is_the_model_bit_for_bit(mlp, rows):
  loss = lambda f: lambda m: mse(f(m, rows), rows)
  out, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss(jaxquant.quantize(batched, "bf16"))))(
    mlp
  )
  want, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss(batched)))(mlp)
  np.testing.assert_array_equal(out, want)
  jax.tree.map(np.testing.assert_array_equal, grads, want_grads)


@pytest.mark.parametrize("recipe", ["fp8_current", "mxfp8"])
def test_quantized_output_is_the_flax_twin_s_bit_for_bit(mlp, rows, recipe):
  out = eqx.filter_jit(jaxquant.quantize(batched, recipe))(mlp, rows)
  model = jqf.quantize_model(FlaxMlp(SIZES), recipe)
  want = jax.jit(model.apply)({"params": flax_mlp_params(mlp)}, rows)
  assert not np.array_equal(out, batched(mlp, rows))  # quantized for real
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("recipe", list(recipes.PRESETS))
def test_mlp_trains_under_every_preset(mlp, rows, recipe):
  qfn = jaxquant.quantize(batched, recipe)
  losses, _ = train(qfn, mlp, rows, mse)
  assert_trains(losses)


def test_roles_are_the_leaves_paths(mlp, rows):
  report = jqfn.swap_report(jaxquant.quantize(batched, "mxfp8"), mlp, rows)
  assert [(r.role, r.shapes) for r in report.rows] == [
    ("layers/0/weight", ((128, 128), (128, 128))),
    ("layers/1/weight", ((128, 128), (128, 128))),
  ]


@pytest.fixture(scope="module")
def sequences():
  return jax.random.normal(jax.random.key(3), (BATCH, SEQ, D))


BLOCK_WEIGHTS = [
  "attention/query_proj/weight",
  "attention/key_proj/weight",
  "attention/value_proj/weight",
  "attention/output_proj/weight",
  "w_in/weight",
  "w_out/weight",
]


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed", "mxfp8"])
def test_transformer_block_trains(sequences, recipe):
  block = EqxBlock(jax.random.key(2))
  qfn = jaxquant.quantize(batched, recipe)
  losses, state = train(qfn, block, sequences, mse)
  assert_trains(losses)
  assert sorted(state) == (sorted(BLOCK_WEIGHTS) if recipe == "fp8_delayed" else [])
  report = jqfn.swap_report(qfn, block, sequences)
  assert [r.role for r in report.quantized] == BLOCK_WEIGHTS
  # Every example's rows in one GEMM: [B * T, features].
  assert {r.shapes[0][:2] for r in report.quantized} == {(BATCH, SEQ)}


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
def test_scanned_stack_trains_under_equinox_s_own_transforms(sequences, recipe):
  """Equinox's train step: `eqx.filter_jit`, `eqx.filter_value_and_grad` of the model and
  the state together, `eqx.apply_updates`."""
  model = EqxStack(jax.random.key(4))
  qfn = jaxquant.quantize(batched, recipe)
  state = qfn.init(model, sequences)
  tx = optax.adam(1e-2)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def step(model, opt_state, state, x):
    def loss_fn(model_and_state):
      out, new_state = qfn.apply(model_and_state[0], x, state=model_and_state[1])
      return mse(out, x), new_state

    (loss, new_state), (grads, state_grads) = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
      (model, state)
    )
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    state = jqfn.update_quant_state(new_state, state_grads)
    return eqx.apply_updates(model, updates), opt_state, state, loss

  losses = []
  for _ in range(4):
    model, opt_state, state, loss = step(model, opt_state, state, sequences)
    losses.append(float(loss))
  assert_trains(np.array(losses))
  if recipe == "fp8_delayed":
    assert sorted(state) == sorted(f"blocks/{w}" for w in BLOCK_WEIGHTS)
    scales = [s["input"].scaling.scale for s in state.values()]
    assert {np.shape(s) for s in scales} == {(2,)}  # one per layer of the stack
    assert all(np.all(np.asarray(s) != 1.0) for s in scales)  # advanced
  else:
    assert state == {}


def test_checkpointed_layers_are_the_same_gemms(sequences):
  """Each scanned layer under `eqx.filter_checkpoint` (its params handed over as
  arguments, under the batch's vmap): the same GEMMs of the whole batch, the same bits."""
  plain, remat = (EqxStack(jax.random.key(4), remat=r) for r in (False, True))
  qfn = jaxquant.quantize(batched, "fp8_delayed")
  state = qfn.init(remat, sequences)
  assert jax.tree.structure(state) == jax.tree.structure(qfn.init(plain, sequences))
  report = jqfn.swap_report(qfn, remat, sequences, state=state)
  assert [r.role for r in report.quantized] == [f"blocks/{w}" for w in BLOCK_WEIGHTS]
  assert {r.shapes[0][:2] for r in report.quantized} == {(BATCH, SEQ)}
  run = eqx.filter_jit(lambda model, state: qfn.apply(model, sequences, state=state))
  jax.tree.map(np.testing.assert_array_equal, run(remat, state), run(plain, state))

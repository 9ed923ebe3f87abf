"""Faults injected into training under the fp8_delayed recipe: no delayed scale locks into
inf or NaN, and a step the train step skips leaves no trace in the quantization state.

A two-layer MLP learns a fixed teacher (y = tanh(x W)) with README's train step
("Train step (Linen, optax)"): `optax.apply_if_finite`, the step's verdict AND-ed with
`jqf.recorded_amaxes_finite` and handed to `update_quant_state(..., finite=)`, plus a
dynamic-loss-scale factor (fp16 logits) for the overflow case. Each run draws batch i at
step i, so runs differ only by their faults. The faults:

- step 0, inputs scaled by 1e-37: the empty history takes a tiny amax alone (fmax / amax
  overflows; the next step computed 0 * inf). Not a skipped step: ordinary data, training
  goes on from it.
- step 10, a batch (inputs and targets) scaled by 1e38: the loss overflows and the step is
  skipped, but its input amax, 1e38, is finite: kept, it would rule the history for
  history_len (1024) steps and quantize every later input to zero.
- step 10, one input inf: FP8 casts saturate it, the loss stays finite; only the recorded
  amax shows it.
- step 10, one input NaN.
- step 10, a loss scale of 2^32 with fp16 logits: the gradients overflow to inf (as an fp16
  dynamic loss scale does before it backs off); the loss itself stays finite.

A skipped step must hand params, optimizer and quantization state back untouched, so the
faulty run goes on as the clean run with that batch left out, bit for bit: that is the
test, and it is also why its loss is within noise of the clean run's. The tiny batch is
trained on, so its run is held to the clean run's final loss within the spread that
leaving one batch out gives (measured: a few percent; the tolerance, 25%, is far from
the failures, NaN or a loss that stalls at 5-7x the clean one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxquant.flax as jqf
import jaxquant.flax.nnx as jqnnx
from jaxquant import recipes

STEPS, FAULT = 40, 10
LOSS_SCALE, OVERFLOWING_LOSS_SCALE = 2.0**10, 2.0**32
FEATURES, OUT = 16, 4
TEACHER = np.random.default_rng(0).normal(size=(FEATURES, OUT)).astype(np.float32) / 4
# The clean run's final loss is about a tenth of its first; a stalled run stays near half.
TOLERANCE = 0.25


def batch(step):
  x = np.random.default_rng(100 + step).normal(size=(64, FEATURES)).astype(np.float32)
  return x, np.tanh(x @ TEACHER)


def faulty(fault, step):
  """Batch `step` with `fault` injected, and the step's loss scale."""
  x, y = batch(step)
  if fault == "tiny":
    x = x * np.float32(1e-37)
  elif fault == "huge":
    factor = np.float32(1e38) / np.abs(x).max()
    x, y = x * factor, y * factor
  elif fault in ("inf", "nan"):
    x[3, 5] = np.inf if fault == "inf" else np.nan
  return x, y, OVERFLOWING_LOSS_SCALE if fault == "overflow" else LOSS_SCALE


def mse(out, y):
  # fp16 logits: their gradient overflows as an fp16 model's would under a too large scale.
  return jnp.mean(jnp.square(out.astype(jnp.float16).astype(jnp.float32) - y))


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(jqf.linen.Dense(32, recipe=recipes.fp8_delayed, name="hidden")(x))
    return jqf.linen.Dense(OUT, recipe=recipes.fp8_delayed, name="head")(h)


MODEL = Mlp()
INIT = jax.jit(MODEL.init)  # one program, not the quantized forward op by op
TX = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)


def loss_fn(params, collections, x, y, loss_scale):
  out, updated = MODEL.apply({"params": params, **collections}, x, mutable=list(collections))
  return loss_scale * mse(out, y), updated


@jax.jit
def train_step(params, opt_state, collections, x, y, loss_scale):
  (scaled, updated), (grads, state_grads) = jax.value_and_grad(
    loss_fn, argnums=(0, 1), has_aux=True
  )(params, collections, x, y, loss_scale)
  grads = jax.tree.map(lambda g: g / loss_scale, grads)
  # An FP8 cast saturates an inf input: the loss and the gradients can stay finite.
  finite = jnp.isfinite(scaled) & jqf.recorded_amaxes_finite(updated, state_grads)
  grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.nan), grads)  # apply_if_finite skips
  updates, opt_state = TX.update(grads, opt_state, params)
  collections = jqf.update_quant_state(updated, state_grads, finite=opt_state.last_finite)
  return optax.apply_updates(params, updates), opt_state, collections, scaled / loss_scale


def role_states(collections):
  return jax.tree.leaves(collections, is_leaf=jqf.is_role_state)


def assert_sound(collections, what):
  """Every scale finite, positive and normal; no history entry inf or NaN."""
  for s in role_states(collections):
    scale, hist = np.asarray(s.scaling.scale), np.asarray(s.scaling.amax_history)
    assert np.isfinite(scale) and scale >= 2.0**-126, (what, s.role, scale)
    assert np.all(np.isfinite(hist)), (what, s.role, hist[np.isfinite(hist) == 0])


def run(fault=None, leave_out=None):
  """Losses of a run; batch `leave_out` is never trained on (the clean run without it)."""
  variables = INIT(jax.random.key(0), jnp.zeros((64, FEATURES)))
  params = nn.unbox(variables.pop("params"))
  collections, opt_state = dict(variables), TX.init(params)
  losses = []
  for step in range(STEPS):
    if step == leave_out:
      losses.append(np.nan)
      continue
    x, y, loss_scale = faulty(fault if step == fault_step(fault) else None, step)
    params, opt_state, collections, loss = train_step(
      params, opt_state, collections, x, y, loss_scale
    )
    assert_sound(collections, f"{fault} after step {step}")
    losses.append(float(loss))
  return np.array(losses), params, collections


def fault_step(fault):
  return 0 if fault == "tiny" else FAULT


@pytest.fixture(scope="module")
def clean():
  return run()


@pytest.fixture(scope="module")
def without_the_fault_batch():
  return run(leave_out=FAULT)


def final_loss(losses):
  return np.mean(losses[-10:])


@pytest.mark.parametrize("fault", ["huge", "inf", "nan", "overflow"])
def test_a_skipped_fault_leaves_the_run_as_if_its_batch_were_left_out(
  clean, without_the_fault_batch, fault
):
  losses, params, collections = run(fault)
  want_losses, want_params, want_collections = without_the_fault_batch
  np.testing.assert_array_equal(losses[FAULT + 1 :], want_losses[FAULT + 1 :], err_msg=fault)
  got_leaves = jax.tree.leaves((params, collections))
  want_leaves = jax.tree.leaves((want_params, want_collections))
  for got, want in zip(got_leaves, want_leaves, strict=True):
    np.testing.assert_array_equal(got, want, err_msg=fault)
  assert abs(final_loss(losses) / final_loss(clean[0]) - 1) < TOLERANCE, (fault, losses)


def test_a_tiny_first_batch_leaves_every_scale_finite_and_training_on_course(
  clean, without_the_fault_batch
):
  # The noise the tolerance is set against: leaving one batch out.
  assert final_loss(clean[0]) < 0.2 * clean[0][0]  # the clean run learns
  spread = abs(final_loss(without_the_fault_batch[0]) / final_loss(clean[0]) - 1)
  assert spread < TOLERANCE / 2, spread
  losses, _, collections = run("tiny")
  assert np.all(np.isfinite(losses)), losses
  assert abs(final_loss(losses) / final_loss(clean[0]) - 1) < TOLERANCE, (losses, clean[0])
  for s in role_states(collections):  # the scales follow the data again
    assert 1.0 < float(s.scaling.scale) < 1e8, (s.role, float(s.scaling.scale))


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    delayed = dict(recipe=recipes.fp8_delayed, rngs=rngs)
    self.hidden = jqnnx.Linear(FEATURES, 32, name="hidden", **delayed)
    self.head = jqnnx.Linear(32, OUT, name="head", **delayed)

  def __call__(self, x):
    return self.head(nnx.gelu(self.hidden(x)))


@nnx.jit
def nnx_train_step(model, optimizer, x, y):
  def loss_fn(model):
    return mse(model(x), y)

  diff = nnx.DiffState(0, (nnx.Param, jqf.QuantState))
  loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
  finite = jnp.isfinite(loss) & jqf.recorded_amaxes_finite(model, grads)
  param_grads = jax.tree.map(
    lambda g: jnp.where(finite, g, jnp.nan), nnx.filter_state(grads, nnx.Param)
  )
  optimizer.update(model, param_grads)
  jqf.update_quant_state(model, grads, finite=finite)
  return loss


def test_nnx_a_skipped_inf_batch_leaves_the_model_as_it_found_it():
  """NNX: the inf batch is skipped (params, optimizer and quantization state untouched),
  the next steps train, every scale finite."""
  model = NnxMlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  for step in range(3):
    nnx_train_step(model, optimizer, *batch(step))
  before = jax.tree.map(np.asarray, nnx.state(model))
  x, y, _ = faulty("inf", 3)
  nnx_train_step(model, optimizer, x, y)
  after = jax.tree.map(np.asarray, nnx.state(model))
  for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(got, want)
  for step in range(4, 8):
    assert np.isfinite(float(nnx_train_step(model, optimizer, *batch(step))))
  assert_sound(nnx.state(model, jqf.QuantState), "nnx")

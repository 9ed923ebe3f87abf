"""A finite outlier batch under fp8_delayed: README's train step with
`update_quant_state(..., outlier_factor=)` recovers within a few steps; without the guard
the batch's amax rules the input's history and training stalls.

A two-layer tanh MLP learns a fixed teacher (y = tanh(x W)); at step FAULT its inputs are
scaled by 1e15. The loss stays finite (the FP8 cast saturates the inputs with the stored
scale, the tanh bounds the rest), so no finiteness check skips the step; but the input's
recorded amax, 1e15, would set its next scale to 448 / 1e15, which quantizes every later
ordinary input to zero for the history's 1024 steps.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import jaxquant.flax as jqf
from jaxquant import recipes

STEPS, FAULT, OUTLIER = 40, 10, 1e15
OUTLIER_FACTOR = 2.0**10  # README's train step's
FEATURES, OUT = 16, 4
TEACHER = np.random.default_rng(0).normal(size=(FEATURES, OUT)).astype(np.float32) / 4


def batch(step, outlier=False):
  x = np.random.default_rng(100 + step).normal(size=(64, FEATURES)).astype(np.float32)
  y = np.tanh(x @ TEACHER)
  return (x * np.float32(OUTLIER) if outlier else x), y


class TanhMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(jqf.linen.Dense(32, recipe=recipes.fp8_delayed, name="hidden")(x))
    return jqf.linen.Dense(OUT, recipe=recipes.fp8_delayed, name="head")(h)


MODEL = TanhMlp()
TX = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5)


def loss_fn(params, collections, x, y):
  out, updated = MODEL.apply({"params": params, **collections}, x, mutable=list(collections))
  return jnp.mean(jnp.square(out - y)), updated


@functools.partial(jax.jit, static_argnames="outlier_factor")
def train_step(params, opt_state, collections, x, y, outlier_factor):
  """README's train step ("Train step (Linen, optax)")."""
  (loss, updated), (grads, state_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
    params, collections, x, y
  )
  finite = jnp.isfinite(loss) & jqf.recorded_amaxes_finite(updated, state_grads)
  grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.nan), grads)
  updates, opt_state = TX.update(grads, opt_state, params)
  collections = jqf.update_quant_state(
    updated, state_grads, finite=opt_state.last_finite, outlier_factor=outlier_factor
  )
  return optax.apply_updates(params, updates), opt_state, collections, loss


def run(outlier_factor, fault):
  variables = jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((64, FEATURES)))
  params = nn.unbox(variables.pop("params"))
  collections, opt_state = dict(variables), TX.init(params)
  losses = []
  for step in range(STEPS):
    x, y = batch(step, outlier=fault and step == FAULT)
    params, opt_state, collections, loss = train_step(
      params, opt_state, collections, x, y, outlier_factor
    )
    losses.append(float(loss))
  jax.effects_barrier()  # the guard's log line, written from the host
  return np.array(losses), collections


@pytest.fixture(scope="module")
def clean():
  return run(None, fault=False)


def test_the_guard_leaves_a_clean_run_bit_for_bit(clean):
  losses, collections = run(OUTLIER_FACTOR, fault=False)
  np.testing.assert_array_equal(losses, clean[0])
  for got, want in zip(jax.tree.leaves(collections), jax.tree.leaves(clean[1]), strict=True):
    np.testing.assert_array_equal(got, want)


def test_unguarded_an_outlier_batch_stalls_training(clean):
  losses, _ = run(None, fault=True)
  assert np.isfinite(losses[FAULT])  # no finiteness check would have skipped it
  assert np.mean(losses[-10:]) > 3 * np.mean(clean[0][-10:]), (losses, clean[0])


def test_guarded_an_outlier_batch_is_skipped_logged_and_training_recovers(clean, caplog):
  with caplog.at_level(logging.WARNING, logger="jaxquant.flax._state"):
    losses, collections = run(OUTLIER_FACTOR, fault=True)
  amax = np.abs(batch(FAULT, outlier=True)[0]).max()
  logged = [r.getMessage() for r in caplog.records]
  assert len(logged) == 1 and f"hidden (input): {amax:g}" in logged[0], logged
  # Within a few steps the loss is back on the clean run's course.
  ratio = losses[FAULT + 3 :] / clean[0][FAULT + 3 :]
  assert np.all(ratio < 1.25), ratio
  hist = collections["quant_state"]["hidden"]["input"].scaling.amax_history
  assert float(jnp.min(hist)) == -amax  # kept as a skipped record

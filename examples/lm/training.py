"""Optimizer, train state and the jitted train and eval steps, for any Flax model.

The steps thread every non-'params' variable collection (jaxquant's 'quant_state' for
delayed scaling, say): they apply the model with those collections mutable and carry the
returned values into the next step. They know no collection by name.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lm.presets import TrainConfig

PARAMS = "params"


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  collections: dict  # every non-'params' variable collection, threaded through the steps


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.peak_learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=config.steps,
      end_value=config.peak_learning_rate * config.final_learning_rate_fraction)
  # No weight decay on vectors (norm scales, biases): decaying them only hurts.
  decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip_norm),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_matrices))


def init_variables(model: nn.Module, key: jax.Array, sample_tokens: jax.Array) -> dict:
  return jax.jit(model.init)(key, sample_tokens)


def init_train_state(model: nn.Module, shared_params: Any, key: jax.Array,
                     sample_tokens: jax.Array, optimizer: optax.GradientTransformation) -> TrainState:
  """A train state for model that starts from shared_params (the same for every recipe).

  The model is initialised only for its other collections; its parameters must have the
  same paths and shapes as shared_params, else the recipes would not start alike.
  """
  variables = init_variables(model, key, sample_tokens)
  expected = jax.tree.map(jnp.shape, shared_params)
  got = jax.tree.map(jnp.shape, variables[PARAMS])
  if expected != got:
    raise ValueError("the recipe's model has other parameters than the plain model "
                     f"(paths or shapes differ):\n plain: {expected}\n recipe: {got}")
  collections = {name: value for name, value in variables.items() if name != PARAMS}
  # A copy: the train step donates its state, and the next recipe needs the originals.
  params = jax.tree.map(jnp.copy, shared_params)
  return TrainState(params=params, opt_state=optimizer.init(params), collections=collections)


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean cross-entropy in nats."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _apply(model: nn.Module, params: Any, collections: dict, windows: jax.Array):
  """Loss of windows [batch, seq + 1] and the collections as the model left them."""
  windows = windows.astype(jnp.int32)
  inputs, targets = windows[:, :-1], windows[:, 1:]
  logits, updated = model.apply({PARAMS: params, **collections}, inputs,
                                mutable=list(collections))
  return next_token_loss(logits, targets), updated


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, jax.Array]]:

  def train_step(state: TrainState, windows: jax.Array):
    loss_and_collections = lambda params: _apply(model, params, state.collections, windows)
    (loss, collections), grads = jax.value_and_grad(loss_and_collections, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params=params, opt_state=opt_state, collections=dict(collections)), loss

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(model: nn.Module) -> Callable[[TrainState, jax.Array], jax.Array]:

  def eval_step(state: TrainState, windows: jax.Array) -> jax.Array:
    # Collections are mutable here too (a layer may write its state on every call), but
    # evaluation keeps none of the changes.
    loss, _ = _apply(model, state.params, state.collections, windows)
    return loss

  return jax.jit(eval_step)

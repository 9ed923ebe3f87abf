"""A train step over a quantized function, as docs/functions.md writes it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxquant import functional as jqfn


def train(qfn, params, batch, loss_of, *, steps=4, lr=1e-2, value_and_grad=jax.value_and_grad):
  """Losses and the last state of `steps` Adam steps of `loss_of(qfn output, batch)` on
  one batch; `qfn`'s params are argument 0, the batch argument 1."""
  state = qfn.init(params, batch)
  tx = optax.adam(lr)
  opt_state = tx.init(params)

  def loss_fn(params, state, key):
    out, new_state = qfn.apply(params, batch, state=state, rng=key)
    return loss_of(out, batch), new_state

  @jax.jit
  def step(params, opt_state, state, key):
    grad = value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (loss, new_state), (grads, state_grads) = grad(params, state, key)
    finite = jnp.isfinite(loss) & jqfn.recorded_amaxes_finite(new_state, state_grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    state = jqfn.update_quant_state(new_state, state_grads, finite=finite)
    return optax.apply_updates(params, updates), opt_state, state, loss

  losses = []
  for i in range(steps):
    params, opt_state, state, loss = step(params, opt_state, state, jax.random.key(100 + i))
    losses.append(float(loss))
  return np.array(losses), state


def assert_trains(losses):
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < 0.8 * losses[0], losses

"""A train step over a quantized function, as docs/functions.md writes it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxquant import functional as jqfn


def train(qfn, params, batch, loss_of, *, steps=4, lr=1e-2):
  """Losses and the last state of `steps` Adam steps of `loss_of(qfn output, batch)` on
  one batch; `qfn`'s params are argument 0 (their array leaves are trained, the others,
  an Equinox module's functions and flags, held), the batch argument 1."""
  leaves, treedef = jax.tree.flatten(params)
  at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

  def rebuild(arrays):
    new = list(leaves)
    for i, array in zip(at, arrays, strict=True):
      new[i] = array
    return jax.tree.unflatten(treedef, new)

  arrays = [leaves[i] for i in at]
  state = qfn.init(params, batch)
  tx = optax.adam(lr)
  opt_state = tx.init(arrays)

  def loss_fn(arrays, state, batch, key):
    out, new_state = qfn.apply(rebuild(arrays), batch, state=state, rng=key)
    return loss_of(out, batch), new_state

  @jax.jit
  def step(arrays, opt_state, state, batch, key):
    grad = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (loss, new_state), (grads, state_grads) = grad(arrays, state, batch, key)
    finite = jnp.isfinite(loss) & jqfn.recorded_amaxes_finite(new_state, state_grads)
    updates, opt_state = tx.update(grads, opt_state, arrays)
    state = jqfn.update_quant_state(new_state, state_grads, finite=finite)
    return optax.apply_updates(arrays, updates), opt_state, state, loss

  losses = []
  for i in range(steps):
    key = jax.random.key(100 + i)
    arrays, opt_state, state, loss = step(arrays, opt_state, state, batch, key)
    losses.append(float(loss))
  return np.array(losses), state


def assert_trains(losses):
  assert np.all(np.isfinite(losses)), losses
  assert losses[-1] < 0.8 * losses[0], losses

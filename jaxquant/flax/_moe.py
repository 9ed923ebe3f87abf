"""A Mixture-of-Experts MLP block (Linen) on `GroupedDense`.

    router:    logits = x @ W_r (high precision, a plain nn.Dense), top-k experts per token,
               weights = softmax over the k chosen logits
    permute:   the T*k (token, expert) pairs sorted by expert (stable), so each expert's
               rows are contiguous; group_sizes = tokens per expert (a device array)
    experts:   h = silu(gate(x_p)) * up(x_p); out_p = down(h), all three GroupedDense
    unpermute: out[t] = sum over its k pairs of weight * out_p (a scatter-add)

Load balancing (Switch Transformer): aux = E * sum_e f_e * P_e, f_e the fraction of
token-expert assignments to e and P_e the mean router probability of e; it is sown
into the "intermediates" collection as "load_balancing_loss" and also returned.
No capacity limit: no token is dropped, every shape is static.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant import recipes
from jaxquant.flax._grouped import GroupedDense


def route(logits: jax.Array, top_k: int):
  """(expert ids [T, k], combine weights [T, k], Switch load-balancing loss)."""
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_logits, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
  weights = jax.nn.softmax(top_logits, axis=-1)
  assigned = jnp.mean(jax.nn.one_hot(experts, num_experts).sum(1), axis=0) / top_k
  aux = num_experts * jnp.sum(assigned * jnp.mean(probs, axis=0))
  return experts, weights, aux


def permute(x: jax.Array, experts: jax.Array, num_experts: int):
  """Rows of x repeated per chosen expert and sorted by expert.

  Returns (x_sorted [T*k, D], order [T*k] (the pair index of each sorted row),
  group_sizes [E] int32).
  """
  tokens, top_k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return x[order // top_k], order, group_sizes


def unpermute(y_sorted: jax.Array, order: jax.Array, weights: jax.Array):
  """out[t] = sum_j weights[t, j] * (row of pair (t, j) in y_sorted)."""
  tokens, top_k = weights.shape
  w = weights.reshape(-1)[order].astype(jnp.float32)[:, None]
  out = jnp.zeros((tokens, y_sorted.shape[-1]), jnp.float32)
  return out.at[order // top_k].add(w * y_sorted.astype(jnp.float32))


class MoE(nn.Module):
  """x [..., D] -> (y [..., D], load-balancing loss)."""

  num_experts: int
  hidden: int
  top_k: int = 2
  recipe: Optional[recipes.CustomRecipe] = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape, d = x.shape, x.shape[-1]
    tokens = x.reshape(-1, d)
    logits = nn.Dense(
      self.num_experts, use_bias=False, param_dtype=self.param_dtype, name="router"
    )(tokens.astype(jnp.float32))
    experts, weights, aux = route(logits, self.top_k)
    self.sow("intermediates", "load_balancing_loss", aux)
    xs, order, sizes = permute(tokens, experts, self.num_experts)
    dense = lambda n, name: GroupedDense(
      self.num_experts, n, recipe=self.recipe, param_dtype=self.param_dtype, name=name
    )
    h = nn.silu(dense(self.hidden, "gate")(xs, sizes)) * dense(self.hidden, "up")(xs, sizes)
    ys = dense(d, "down")(h, sizes)
    return unpermute(ys, order, weights).astype(x.dtype).reshape(shape), aux

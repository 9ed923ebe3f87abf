"""One MoE block as a Flax user writes it today, in the two ways its experts are written.

    h = RMSNorm(x); probs = softmax(h @ W_router + route_bias); top-k experts per token,
    their probabilities renormalized; each (token, expert) pair through its expert's
    SwiGLU MLP, w_in [E, d, 2f] (gate and up side by side) and w_out [E, f, d];
    y = x + sum over the token's pairs of weight * expert output.

`dispatch="ragged"`: the pairs sorted by expert and both expert GEMMs as stock
`jax.lax.ragged_dot` (gemma 4's and MaxText's sparse-matmul experts).
`dispatch="padded"`: each pair placed at its position within its expert in an
[E, capacity, d] buffer (capacity = capacity_factor * T * k / E, rounded up to a multiple
of 128), experts as batched einsums `ecd,edf->ecf`, pairs past the capacity dropped (the
dense-dispatch MoE of Switch Transformer and MaxText, with scatter and gather in place of
dispatch masks). Both hold the same params, so every variant trains the same tree.

`route_bias` [E] is an input, not a param: zeros give the router's own (balanced, at
random init) routing; `skewed_route_bias` a fixed Dirichlet-skewed one, so one compiled
step is timed under both routings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxquant.flax as jqf


@dataclasses.dataclass(frozen=True)
class MoEShape:
  d_model: int
  experts: int
  top_k: int
  ffn: int  # each expert's hidden width
  tokens: int

  def expert_gemm_flops(self) -> float:
    """FLOPs of the expert GEMMs of one train step, routed pairs only (fwd + dgrad + wgrad
    of the [d, 2f] and [f, d] GEMMs)."""
    pairs = self.tokens * self.top_k
    return 3 * (2 * pairs * self.d_model * 2 * self.ffn + 2 * pairs * self.ffn * self.d_model)

  def capacity(self, factor: float) -> int:
    mean = self.tokens * self.top_k / self.experts
    return 128 * math.ceil(factor * mean / 128)


SHAPES = {
  # DeepSeek-V2-Lite class: many small experts.
  "fine": MoEShape(d_model=2048, experts=64, top_k=6, ffn=1408, tokens=16384),
  # Mixtral class: few large experts.
  "coarse": MoEShape(d_model=4096, experts=8, top_k=2, ffn=14336, tokens=16384),
  # A smoke-test size.
  "tiny": MoEShape(d_model=128, experts=8, top_k=2, ffn=64, tokens=256),
}


def skewed_route_bias(experts: int, concentration: float = 0.5, seed: int = 0) -> np.ndarray:
  """log of a Dirichlet(concentration) draw: a fixed router preference, some experts taking
  several times their share of the pairs."""
  share = np.random.default_rng(seed).dirichlet(np.full(experts, concentration))
  return np.log(np.maximum(share, 1e-6)).astype(np.float32)


def route(logits: jax.Array, top_k: int):
  """(expert ids [T, k], combine weights [T, k] fp32): top-k of the softmax, renormalized."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  return experts, weights / jnp.sum(weights, axis=-1, keepdims=True)


def swiglu(gate_up: jax.Array) -> jax.Array:
  gate, up = jnp.split(gate_up, 2, axis=-1)
  return jax.nn.silu(gate) * up


class MoEBlock(nn.Module):
  """x [T, d] bf16, route_bias [E] fp32 -> x + MoE(RMSNorm(x)), bf16. Params fp32."""

  shape: MoEShape
  dispatch: str = "ragged"  # or "padded"
  capacity_factor: float = 1.25
  # The ragged dispatch's expert GEMM: (x [rows, K], w [E, K, N], group sizes [E]) -> [rows, N].
  ragged_dot: Callable = jax.lax.ragged_dot

  @nn.compact
  def __call__(self, x, route_bias):
    s = self.shape
    h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="norm")(x)
    logits = nn.Dense(s.experts, use_bias=False, dtype=jnp.float32, name="router")(
      h.astype(jnp.float32)
    )
    experts, weights = route(logits + route_bias, s.top_k)
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1)
    w_in = self.param("w_in", init, (s.experts, s.d_model, 2 * s.ffn), jnp.float32)
    w_out = self.param("w_out", init, (s.experts, s.ffn, s.d_model), jnp.float32)
    w_in, w_out = w_in.astype(jnp.bfloat16), w_out.astype(jnp.bfloat16)
    if self.dispatch == "ragged":
      out = _ragged_experts(h, experts, weights, w_in, w_out, self.ragged_dot)
    elif self.dispatch == "padded":
      out = _padded_experts(h, experts, weights, w_in, w_out, s.capacity(self.capacity_factor))
    else:
      raise ValueError(f"dispatch must be 'ragged' or 'padded', got {self.dispatch!r}")
    return (x.astype(jnp.float32) + out).astype(jnp.bfloat16)


def _ragged_experts(h, experts, weights, w_in, w_out, ragged_dot):
  tokens, top_k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=w_in.shape[0]).astype(jnp.int32)
  xs = h[order // top_k]
  ys = ragged_dot(swiglu(ragged_dot(xs, w_in, sizes)), w_out, sizes)
  w = weights.reshape(-1)[order][:, None]
  out = jnp.zeros((tokens, h.shape[-1]), jnp.float32)
  return out.at[order // top_k].add(w * ys.astype(jnp.float32))


def _padded_experts(h, experts, weights, w_in, w_out, capacity):
  tokens, top_k = experts.shape
  num_experts = w_in.shape[0]
  flat = experts.reshape(-1)  # pair p = (token p // k, its (p % k)-th expert)
  one_hot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
  position = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=1)  # within its expert
  kept = position < capacity
  slot = jnp.where(kept, position, capacity)  # out of range: dropped by the scatter
  token = jnp.arange(tokens * top_k) // top_k
  buffer = jnp.zeros((num_experts, capacity, h.shape[-1]), h.dtype)
  buffer = buffer.at[flat, slot].set(h[token], mode="drop")
  gate_up = jnp.einsum("ecd,edf->ecf", buffer, w_in)
  ys = jnp.einsum("ecf,efd->ecd", swiglu(gate_up), w_out)
  picked = ys.at[flat, slot].get(mode="fill", fill_value=0)
  w = jnp.where(kept, weights.reshape(-1), 0.0)[:, None]
  return jnp.sum((w * picked.astype(jnp.float32)).reshape(tokens, top_k, -1), axis=1)


class JaxquantMoEBlock(nn.Module):
  """x + jaxquant.flax.MoE(RMSNorm(x)): jaxquant's own MoE module (three GroupedDense
  experts, gate, up and down, and its own router), under `recipe`. route_bias is unused:
  the module routes by its router alone."""

  shape: MoEShape
  recipe: object = None  # a jaxquant CustomRecipe

  @nn.compact
  def __call__(self, x, route_bias):
    s = self.shape
    h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32, name="norm")(x)
    moe = jqf.MoE(s.experts, s.ffn, top_k=s.top_k, recipe=self.recipe, name="moe")
    out, _ = moe(h)
    return (x.astype(jnp.float32) + out.astype(jnp.float32)).astype(jnp.bfloat16)

"""A Llama-shaped decoder stack built from stock Flax Linen layers, for the step benchmark.

Each layer: RMSNorm, grouped-query attention (separate q/k/v/o projections, rotary
embeddings, causal `jax.nn.dot_product_attention`), RMSNorm, SwiGLU MLP (gate, up, down),
residual adds; every GEMM an `nn.Dense` without bias, as Llama has none. No embedding and
no logits head: the stack maps activations [batch, seq, d_model] to the same shape, so
every GEMM of the step is a decoder layer's, the ones a recipe quantizes (a head would
be kept in bf16 by the usual recipes anyway). Parameters fp32, compute bf16, norms and
the rotary angles in fp32.

`dot_general_cls` is Flax's own hook for an FP8 dot (`flax.linen.fp8_ops`); it is passed
to every projection and nothing else. `remat_policy` rematerializes each layer (`nn.remat`)
under that `jax.checkpoint` policy; the param tree is the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Shape:
  d_model: int
  n_heads: int
  n_kv_heads: int
  d_ff: int

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


# Llama 3 8B and Llama 3.2 1B (both grouped-query attention with 8 key/value heads), and
# a tiny one for CPU smoke runs.
SHAPES = {
  "8b": Shape(d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336),
  "1b": Shape(d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192),
  "tiny": Shape(d_model=256, n_heads=4, n_kv_heads=2, d_ff=512),
}

# Every projection's module name ends so; a peer that selects layers by module path
# (Qwix's rules) is given this, so it quantizes exactly the GEMMs jaxquant's swap-in does
# and not the attention's own dots.
PROJECTION_PATH_REGEX = r".*_proj"


def rotary(x: jax.Array, base: float = 500000.0) -> jax.Array:
  """Rotates pairs of features of x [batch, seq, heads, head_dim] by position (RoPE)."""
  seq, half = x.shape[1], x.shape[3] // 2
  frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies[None, :]
  sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(
    x.dtype
  )


class DecoderStack(nn.Module):
  """[batch, seq, d_model] bf16 -> same: `layers` Llama decoder layers."""

  shape: Shape
  layers: int
  # jax.nn.dot_product_attention's implementation: "cudnn" (flash attention, GPU) or
  # None (XLA's, scores materialized).
  attention: Optional[str] = "cudnn"
  dot_general_cls: Any = None
  # A jax.checkpoint policy each layer is rematerialized under (nn.remat), or None: no remat.
  remat_policy: Optional[Callable] = None

  def _dense(self, features: int, name: str) -> nn.Dense:
    return nn.Dense(
      features,
      use_bias=False,
      dtype=jnp.bfloat16,
      param_dtype=jnp.float32,
      kernel_init=nn.initializers.normal(stddev=0.02),
      dot_general_cls=self.dot_general_cls,
      name=name,
    )

  def _norm(self, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(epsilon=1e-5, dtype=jnp.bfloat16, param_dtype=jnp.float32, name=name)

  def _attention(self, x: jax.Array, prefix: str) -> jax.Array:
    s = self.shape
    batch, seq, _ = x.shape
    heads = lambda t, n: t.reshape(batch, seq, n, s.head_dim)
    q = rotary(heads(self._dense(s.n_heads * s.head_dim, f"{prefix}q_proj")(x), s.n_heads))
    k = rotary(heads(self._dense(s.n_kv_heads * s.head_dim, f"{prefix}k_proj")(x), s.n_kv_heads))
    v = heads(self._dense(s.n_kv_heads * s.head_dim, f"{prefix}v_proj")(x), s.n_kv_heads)
    attended = self._attend(q, k, v)
    return self._dense(s.d_model, f"{prefix}o_proj")(attended.reshape(batch, seq, s.d_model))

  def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of [batch, seq, heads, head_dim] queries, keys and values."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)

  def _mlp(self, x: jax.Array, prefix: str) -> jax.Array:
    gate = self._dense(self.shape.d_ff, f"{prefix}gate_proj")(x)
    up = self._dense(self.shape.d_ff, f"{prefix}up_proj")(x)
    return self._dense(self.shape.d_model, f"{prefix}down_proj")(nn.silu(gate) * up)

  def _layer(self, x: jax.Array, prefix: str) -> jax.Array:
    x = x + self._attention(self._norm(f"{prefix}attention_norm")(x), prefix)
    return x + self._mlp(self._norm(f"{prefix}mlp_norm")(x), prefix)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for i in range(self.layers):
      # Flat module names (layer_0_q_proj, ...): one level, so role names, Qwix's
      # module paths and the param tree read alike, rematerialized or not.
      prefix = f"layer_{i}_"
      layer = lambda module, x, prefix=prefix: module._layer(x, prefix)
      if self.remat_policy is not None:
        layer = nn.remat(layer, policy=self.remat_policy)
      x = layer(self, x)
    return x

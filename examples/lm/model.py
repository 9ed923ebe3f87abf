"""A plain Flax Linen decoder-only transformer over byte tokens.

Every GEMM is an `nn.Dense`, so `jaxquant.flax.quantize_model` can swap them for quantized
layers without this file knowing about quantization (beyond the names of the collection
and RNG stream nn.scan must stack per layer). The module paths are the names the
recipe's roles see, e.g. 'decoder/layer_3/mlp/wi' or 'decoder/layer_0/attention/qkv'.

Parameters are fp32; activations and GEMMs run in `ModelConfig.dtype` (bf16), norms and
softmax statistics in fp32, logits are returned in fp32 for the loss.

Every parameter's initializer names its axes (`nn.with_logical_partitioning`; the scanned
layers' stacked axis is LAYERS): `lm/sharding.py` maps the names to mesh axes. The names
live only in the boxes `init` returns; the train state holds the unboxed arrays, so the
param tree and its values are those of the unannotated model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxquant.flax import QUANT_RNG, QUANT_STATE


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  seq_len: int = 128
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 512
  dtype: Any = jnp.bfloat16
  init_std: float = 0.02
  # jax.nn.dot_product_attention's `implementation`: None is XLA's (it materializes the
  # [batch, heads, seq, seq] scores), "cudnn" the fused flash attention (GPU only).
  attention_implementation: Optional[str] = None
  # The first `scanned_layers` decoder layers run under nn.scan: one module,
  # 'decoder/layers', whose params (and delayed-scaling state) stack along a leading
  # axis, compiled once however many layers it holds. The rest are separate modules,
  # 'decoder/layer_<i>', which a per-layer recipe can treat differently.
  scanned_layers: int = 0

  def __post_init__(self):
    if not 0 <= self.scanned_layers <= self.n_layers:
      raise ValueError(
        f"scanned_layers={self.scanned_layers} must be in [0, n_layers={self.n_layers}]"
      )
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError(
        f"head dim {self.d_model // self.n_heads} must be even for rotary embeddings"
      )


# The MoE hook. A factory `moe_mlp_factory(config, name=...)` returns a module mapping
# [batch, seq, d_model] -> [batch, seq, d_model]; it replaces every block's MLP (lm/moe.py
# builds one on jaxquant's MoE block).
MoeMlpFactory = Callable[..., nn.Module]
# Any module may sow auxiliary losses (already weighted, e.g. MoE load balancing) into this
# collection; the train step adds their sum to the loss it differentiates.
AUX_LOSSES = "aux_losses"


def rotary_embedding(x: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotates pairs of features of x [batch, seq, heads, head_dim] by position (RoPE)."""
  seq_len, head_dim = x.shape[1], x.shape[3]
  half = head_dim // 2
  inverse_frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inverse_frequencies[None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


def fused_attention_compiles(config: ModelConfig) -> bool:
  """Whether cuDNN's fused attention, forward and backward, compiles for config's shapes here."""
  head_dim = config.d_model // config.n_heads
  qkv = jnp.zeros((1, config.seq_len, config.n_heads, head_dim), config.dtype)
  attention_sum = lambda q, k, v: (
    jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    .astype(jnp.float32)
    .sum()
  )
  try:
    jax.jit(jax.grad(attention_sum, argnums=(0, 1, 2))).lower(qkv, qkv, qkv).compile()
  except Exception as error:  # any failure (no GPU, old cuDNN, shapes) means: use XLA's
    print(
      f"cuDNN fused attention unavailable ({type(error).__name__}: {str(error)[:200]}); "
      "using XLA's attention"
    )
    return False
  return True


# Logical axis names of the parameters (lm/sharding.py's rules map them to mesh axes).
EMBED = "embed"  # the model dimension
MLP = "mlp"  # the MLP's hidden dimension
QKV = "qkv"  # query, key and value of every head, side by side
HEADS = "heads"  # the attention heads' outputs, heads x head_dim
VOCAB = "vocab"  # the head's outputs
TABLE = "table"  # the embedding table's rows (one per token); its columns take no name
NORM = "norm"  # a norm's scale
LAYERS = "layers"  # the stacked axis of the scanned layers' params


def _dense(
  features: int, name: str, config: ModelConfig, std: float, axes: tuple[str, str]
) -> nn.Dense:
  """axes: the logical names of the kernel's (input, output) dims; the bias takes the output's."""
  return nn.Dense(
    features,
    name=name,
    dtype=config.dtype,
    param_dtype=jnp.float32,
    kernel_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=std), axes),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]),
  )


def _rms_norm(name: str, config: ModelConfig) -> nn.RMSNorm:
  return nn.RMSNorm(
    dtype=config.dtype,
    name=name,
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, (NORM,)),
  )


class CausalSelfAttention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    batch, seq_len, _ = x.shape
    head_dim = cfg.d_model // cfg.n_heads
    # Residual-branch outputs start smaller so the residual stream's variance does not
    # grow with depth (GPT-2's scaled init).
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5

    # One GEMM for query, key and value: the input is quantized once, not three times.
    qkv = _dense(3 * cfg.d_model, "qkv", cfg, cfg.init_std, (EMBED, QKV))(x)
    query, key, value = jnp.split(qkv.reshape(batch, seq_len, 3 * cfg.n_heads, head_dim), 3, axis=2)
    query, key = rotary_embedding(query), rotary_embedding(key)
    attended = jax.nn.dot_product_attention(
      query, key, value, is_causal=True, implementation=cfg.attention_implementation
    )
    attended = attended.reshape(batch, seq_len, cfg.d_model)
    return _dense(cfg.d_model, "out", cfg, out_std, (HEADS, EMBED))(attended)


class Mlp(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    hidden = nn.gelu(_dense(cfg.d_ff, "wi", cfg, cfg.init_std, (EMBED, MLP))(x))
    return _dense(cfg.d_model, "wo", cfg, cfg.init_std / (2 * cfg.n_layers) ** 0.5, (MLP, EMBED))(
      hidden
    )


class DecoderLayer(nn.Module):
  config: ModelConfig
  moe_mlp_factory: Optional[MoeMlpFactory] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    x = x + CausalSelfAttention(cfg, name="attention")(_rms_norm("attention_norm", cfg)(x))
    normed = _rms_norm("mlp_norm", cfg)(x)
    if self.moe_mlp_factory is None:
      mlp = Mlp(cfg, name="mlp")
    else:
      mlp = self.moe_mlp_factory(cfg, name="mlp")
    return x + mlp(normed)


# nn.scan must name every collection a layer holds its own variables in (stacked along
# the layer axis) and every RNG stream it splits per layer: besides Flax's own, those of
# the layers jaxquant swaps in (delayed-scaling state, stochastic rounding's keys).
_PER_LAYER_COLLECTIONS = ("params", QUANT_STATE, AUX_LOSSES)
_PER_LAYER_RNGS = ("params", QUANT_RNG)
SCANNED_LAYERS = "layers"


class _ScanStep(nn.Module):
  """One decoder layer as nn.scan's body: (carry, _) -> (carry, None)."""

  config: ModelConfig
  moe_mlp_factory: Optional[MoeMlpFactory] = None

  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    return DecoderLayer(self.config, self.moe_mlp_factory, name="layer")(x), None


class Decoder(nn.Module):
  config: ModelConfig
  moe_mlp_factory: Optional[MoeMlpFactory] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    if cfg.scanned_layers:
      scan = nn.scan(
        _ScanStep,
        variable_axes={c: 0 for c in _PER_LAYER_COLLECTIONS},
        split_rngs={r: True for r in _PER_LAYER_RNGS},
        length=cfg.scanned_layers,
        metadata_params={nn.PARTITION_NAME: LAYERS},
      )
      x, _ = scan(cfg, self.moe_mlp_factory, name=SCANNED_LAYERS)(x, None)
    for index in range(cfg.scanned_layers, cfg.n_layers):
      x = DecoderLayer(cfg, self.moe_mlp_factory, name=f"layer_{index}")(x)
    return _rms_norm("final_norm", cfg)(x)


class TransformerLM(nn.Module):
  """tokens [batch, seq] int -> next-token logits [batch, seq, vocab] fp32."""

  config: ModelConfig
  moe_mlp_factory: Optional[MoeMlpFactory] = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.config
    # The lookup runs in fp32 and only its result is cast: with dtype=bf16, nn.Embed casts
    # the table first, so the backward scatter-adds every token's gradient into a bf16
    # table (about 14% error on the embedding gradient at batch 8x256, measured against fp32).
    x = nn.Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(stddev=cfg.init_std), (TABLE, None)
      ),
      name="embed",
    )(tokens).astype(cfg.dtype)
    x = Decoder(cfg, self.moe_mlp_factory, name="decoder")(x)
    logits = _dense(cfg.vocab_size, "head", cfg, cfg.init_std, (EMBED, VOCAB))(x)
    return logits.astype(jnp.float32)

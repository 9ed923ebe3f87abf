"""Tiny models whose GEMMs live in their own layers, as real JAX models write them (no
jaxquant, no stock Flax GEMM layer), and twins of them built from stock layers with the
same params.

- `GemmaStyleLM` (Linen): an `Einsum(nn.Module)` that creates its weight and calls
  `jnp.einsum`; attention projections with `NDH` / `NHD` weights, a `[2, F, H]` gating
  weight ('...F,NFH->...NH'), and the embedding table reused as the logits head through
  `jnp.dot(x, table.T)`. `StockGemmaLM`: the same with `nn.Einsum` and `nn.Embed`.
- `MaxTextStyleLM` (Linen): a `DenseGeneral` that casts its kernel and calls
  `lax.dot_general`, or `quant.dot_general_cls(mesh_axes)()` when given a `quant`.
- `NnxCustomLM` (NNX): a module whose call is `x @ self.w[...]` (Flax 0.12's spelling of
  `x @ self.w.value`); `stock=True`: the same with `nnx.Linear`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB, D, HEADS, HEAD_DIM, FF, SEQ, BATCH = 64, 64, 2, 32, 128, 16, 4
DTYPE = jnp.bfloat16


def _init(names):
  return nn.with_logical_partitioning(nn.initializers.normal(0.05), names)


# ---- (a) gemma style ----


class Einsum(nn.Module):
  """The model's own GEMM layer: a weight of `shape`, contracted by `jnp.einsum`."""

  shape: tuple
  axes: tuple  # logical axis names of the weight
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, equation, x):
    w = self.param("w", _init(self.axes), self.shape)
    return jnp.einsum(equation, x, w.astype(self.dtype))


class Embedder(nn.Module):
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self):
    return self.param("table", _init(("vocab", "embed")), (VOCAB, D))

  def encode(self, tokens):
    return jnp.take(self(), tokens, axis=0).astype(self.dtype)

  def decode(self, x):
    return jnp.dot(x, jnp.asarray(self(), self.dtype).T)


def attend(q, k, v):
  """Scores and probabilities times values: contractions of two activations."""
  scores = jnp.einsum("BTNH,BSNH->BNTS", q, k) / np.sqrt(HEAD_DIM)
  mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
  probs = jax.nn.softmax(jnp.where(mask, scores.astype(jnp.float32), -1e9), axis=-1)
  return jnp.einsum("BNTS,BSNH->BTNH", probs.astype(v.dtype), v)


def rms_norm(x):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6)).astype(x.dtype)


# The weights' shapes, equations and logical axes, shared by the custom and stock layers.
ATTENTION = {
  "q_einsum": ((HEADS, D, HEAD_DIM), "BTD,NDH->BTNH", ("heads", "embed", "kv")),
  "k_einsum": ((HEADS, D, HEAD_DIM), "BSD,NDH->BSNH", ("heads", "embed", "kv")),
  "v_einsum": ((HEADS, D, HEAD_DIM), "BSD,NDH->BSNH", ("heads", "embed", "kv")),
  "attn_vec_einsum": ((HEADS, HEAD_DIM, D), "BTNH,NHD->BTD", ("heads", "kv", "embed")),
}
MLP = {
  "gating_einsum": ((2, D, FF), "...F,NFH->...NH", ("gate", "embed", "mlp")),
  "linear": ((FF, D), "...H,HF->...F", ("mlp", "embed")),
}
# The roles the recipe sees: every weight GEMM, named by its param's path (a param not
# named `kernel` keeps its name); the head is the embedder's table.
GEMMA_ROLES = (
  tuple(f"layer_0/attn/{n}/w" for n in ATTENTION)
  + tuple(f"layer_0/mlp/{n}/w" for n in MLP)
  + ("embedder/table",)
)
HEAD_ROLE = "embedder/table"


class Block(nn.Module):
  layer: type = Einsum
  dtype: jnp.dtype = DTYPE

  def _project(self, name, spec, x):
    shape, equation, axes = spec
    if self.layer is Einsum:
      return Einsum(shape, axes, self.dtype, name=name)(equation, x)
    return nn.Einsum(
      shape, equation, use_bias=False, dtype=self.dtype, name=name, kernel_init=_init(axes)
    )(x)

  @nn.compact
  def __call__(self, x):
    attn = AttentionBlock(self.layer, self.dtype, name="attn")
    x = x + attn(rms_norm(x))
    mlp = MlpBlock(self.layer, self.dtype, name="mlp")
    return x + mlp(rms_norm(x))


class AttentionBlock(Block):
  @nn.compact
  def __call__(self, x):
    q, k, v = (self._project(n, ATTENTION[n], x) for n in ("q_einsum", "k_einsum", "v_einsum"))
    return self._project("attn_vec_einsum", ATTENTION["attn_vec_einsum"], attend(q, k, v))


class MlpBlock(Block):
  @nn.compact
  def __call__(self, x):
    gate = self._project("gating_einsum", MLP["gating_einsum"], x)
    hidden = jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
    return self._project("linear", MLP["linear"], hidden)


class GemmaStyleLM(nn.Module):
  """tokens [batch, seq] -> logits [batch, seq, vocab] fp32; `dtype` the compute dtype."""

  layer: type = Einsum
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, tokens):
    embedder = Embedder(self.dtype, name="embedder")
    x = embedder.encode(tokens)
    x = Block(self.layer, self.dtype, name="layer_0")(x)
    return embedder.decode(rms_norm(x)).astype(jnp.float32)


def StockGemmaLM():  # noqa: N802 (a model constructor, like the class beside it)
  """GemmaStyleLM from stock nn.Einsum layers (param "kernel" where the custom has "w")."""
  return GemmaStyleLM(layer=nn.Einsum)


def as_custom_params(stock_tree):
  """A stock tree's leaves under the custom model's param names ("kernel" -> "w")."""
  if isinstance(stock_tree, dict):
    return {("w" if k == "kernel" else k): as_custom_params(v) for k, v in stock_tree.items()}
  return stock_tree


# ---- (b) MaxText style ----


class DenseGeneral(nn.Module):
  """MaxText's dense layer: casts its kernel, then `lax.dot_general`, or the
  quantization's `dot_general_cls(mesh_axes)()` when `quant` is given."""

  features: tuple
  axis: tuple = (-1,)
  kernel_axes: tuple = ()
  quant: object = None
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, inputs):
    axis = tuple(a % inputs.ndim for a in self.axis)
    kernel_shape = tuple(inputs.shape[a] for a in axis) + tuple(self.features)
    kernel = self.param("kernel", _init(self.kernel_axes), kernel_shape)
    kernel = jnp.asarray(kernel, self.dtype)
    inputs = jnp.asarray(inputs, self.dtype)
    contract_ind = tuple(range(len(axis)))
    dot_general = jax.lax.dot_general
    if self.quant is not None:
      dot_general = self.quant.dot_general_cls(mesh_axes=self.kernel_axes)()
    return dot_general(inputs, kernel, ((axis, contract_ind), ((), ())), precision=None)


class MaxTextStyleLM(nn.Module):
  """`stock=True`: the same model from nn.DenseGeneral (the same param tree)."""

  quant: object = None
  stock: bool = False

  @nn.compact
  def __call__(self, tokens):
    def dense(features, axes, name, axis=(-1,)):
      if self.stock:
        return nn.DenseGeneral(
          features, axis, use_bias=False, dtype=DTYPE, name=name, kernel_init=_init(axes)
        )
      return DenseGeneral(features, axis, axes, self.quant, name=name)

    x = nn.Embed(VOCAB, D, dtype=DTYPE, name="token_embedder")(tokens)
    h = rms_norm(x)
    q, k, v = (
      dense((HEADS, HEAD_DIM), ("embed", "heads", "kv"), n)(h) for n in ("query", "key", "value")
    )
    x = x + dense((D,), ("heads", "kv", "embed"), "out", axis=(-2, -1))(attend(q, k, v))
    h = rms_norm(x)
    hidden = jax.nn.silu(dense((FF,), ("embed", "mlp"), "wi_0")(h)) * dense(
      (FF,), ("embed", "mlp"), "wi_1"
    )(h)
    x = x + dense((D,), ("mlp", "embed"), "wo")(hidden)
    return dense((VOCAB,), ("embed", "vocab"), "logits_dense")(rms_norm(x)).astype(jnp.float32)


MAXTEXT_ROLES = ("query", "key", "value", "out", "wi_0", "wi_1", "wo", "logits_dense")
MAXTEXT_HEAD_ROLE = "logits_dense"


# ---- (c) NNX ----


class NnxDense(nnx.Module):
  """The model's own NNX GEMM layer: `x @ self.w[...]`, or `x @ self.w.value` as code
  written before Flax 0.12 deprecated `.value` reads it (`read_value=True`)."""

  def __init__(self, d_in, d_out, rngs, read_value=False):
    self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out)))
    self.read_value = read_value

  def __call__(self, x):
    return x @ (self.w.value if self.read_value else self.w[...])


class NnxCustomLM(nnx.Module):
  """tokens -> logits fp32; an MLP block and a head, each an `NnxDense` (or nnx.Linear)."""

  def __init__(self, rngs, stock=False, read_value=False):
    dense = (
      (lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs))
      if stock
      else (lambda i, o: NnxDense(i, o, rngs, read_value))
    )
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.wi = dense(D, FF)
    self.wo = dense(FF, D)
    self.head = dense(D, VOCAB)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.wo(jax.nn.gelu(self.wi(x)))
    return self.head(x).astype(jnp.float32)


NNX_LAYERS = ("wi", "wo", "head")
NNX_ROLES = tuple(f"{n}/w" for n in NNX_LAYERS)  # each layer's param `w`
NNX_HEAD_ROLE = "head/w"

"""Models written without Flax, as their users write them, and their Flax twins.

- A nanoGPT-style plain-JAX GPT: a params dict, `jnp.einsum` attention, the layers'
  params stacked and run by `lax.scan` (`gpt_params`, `gpt`), and the same model in Flax
  Linen with `nn.scan` (`FlaxGpt`), which takes the same params tree.
- Equinox models written for one example and batched with `jax.vmap`: an MLP of
  `eqx.nn.Linear` (`EqxMlp`, its Flax twin `FlaxMlp`), a transformer block with
  `eqx.nn.MultiheadAttention` (`EqxBlock`), and a stack of blocks made with
  `eqx.filter_vmap` and run by `lax.scan`, each under `eqx.filter_checkpoint` or not
  (`EqxStack`).
"""

import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp

VOCAB, D, HEADS, FF, LAYERS, SEQ, BATCH = 64, 64, 2, 128, 2, 16, 4


def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * scale


def gpt_params(key, layers=LAYERS):
  keys = iter(jax.random.split(key, 8))
  normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) / math.sqrt(fan_in)
  head_dim = D // HEADS
  return {
    "wte": normal((VOCAB, D), 1) * 0.02,
    "wpe": normal((SEQ, D), 1) * 0.02,
    "layers": {
      "ln1": jnp.ones((layers, D)),
      "w_qkv": normal((layers, D, 3, HEADS, head_dim), D),
      "w_o": normal((layers, HEADS, head_dim, D), D),
      "ln2": jnp.ones((layers, D)),
      "w_in": normal((layers, D, FF), D),
      "w_out": normal((layers, FF, D), FF),
    },
    "ln_f": jnp.ones((D,)),
    "head": normal((D, VOCAB), D),
  }


def gpt_block(x, layer):
  """One pre-norm decoder layer of `layer`, its params (one slice of the stack)."""
  t = x.shape[1]
  h = rms_norm(x, layer["ln1"])
  q, k, v = jnp.einsum("btd,dkhe->kbthe", h, layer["w_qkv"])
  scores = jnp.einsum("bthe,bshe->bhts", q, k) / math.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((t, t), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  attended = jnp.einsum("bhts,bshe->bthe", probs, v)
  x = x + jnp.einsum("bthe,hed->btd", attended, layer["w_o"])
  h = rms_norm(x, layer["ln2"])
  return x + jax.nn.gelu(h @ layer["w_in"]) @ layer["w_out"]


def gpt(params, tokens):
  """Logits [B, T, VOCAB] of `tokens` [B, T]."""
  x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
  x, _ = jax.lax.scan(lambda x, layer: (gpt_block(x, layer), None), x, params["layers"])
  return rms_norm(x, params["ln_f"]) @ params["head"]


def gpt_loss(logits, tokens):
  targets = jnp.roll(tokens, -1, axis=1)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def gpt_batch(seed=1):
  return jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, VOCAB)


class FlaxGptLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    head_dim = D // HEADS
    init = nn.initializers.zeros
    layer = {
      "ln1": self.param("ln1", init, (D,)),
      "w_qkv": self.param("w_qkv", init, (D, 3, HEADS, head_dim)),
      "w_o": self.param("w_o", init, (HEADS, head_dim, D)),
      "ln2": self.param("ln2", init, (D,)),
      "w_in": self.param("w_in", init, (D, FF)),
      "w_out": self.param("w_out", init, (FF, D)),
    }
    return gpt_block(x, layer), None


class FlaxGpt(nn.Module):
  """`gpt` in Flax Linen: the same computation, the same params tree."""

  layers: int = LAYERS

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.zeros
    wte = self.param("wte", init, (VOCAB, D))
    wpe = self.param("wpe", init, (SEQ, D))
    x = wte[tokens] + wpe[: tokens.shape[1]]
    stack = nn.scan(
      FlaxGptLayer,
      variable_axes={"params": 0, "quant_state": 0},
      split_rngs={"params": True},
      length=self.layers,
    )
    x, _ = stack(name="layers")(x, None)
    return rms_norm(x, self.param("ln_f", init, (D,))) @ self.param("head", init, (D, VOCAB))


class EqxMlp(eqx.Module):
  """An MLP for one example [features], as Equinox writes it."""

  layers: list

  def __init__(self, sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    pairs = zip(sizes[:-1], sizes[1:], keys, strict=True)
    self.layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in pairs]

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jax.nn.gelu(layer(x))
    return self.layers[-1](x)


class FlaxMlp(nn.Module):
  """`EqxMlp` in Flax, for a batch [B, features]; its kernels are the Linear weights
  transposed (`flax_mlp_params`)."""

  sizes: tuple

  @nn.compact
  def __call__(self, x):
    for i, size in enumerate(self.sizes[1:-1]):
      x = jax.nn.gelu(nn.Dense(size, name=f"layers_{i}")(x))
    return nn.Dense(self.sizes[-1], name=f"layers_{len(self.sizes) - 2}")(x)


def flax_mlp_params(model: EqxMlp):
  return {
    f"layers_{i}": {"kernel": layer.weight.T, "bias": layer.bias}
    for i, layer in enumerate(model.layers)
  }


class EqxBlock(eqx.Module):
  """A pre-norm transformer block for one sequence [T, D]."""

  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  w_in: eqx.nn.Linear
  w_out: eqx.nn.Linear

  def __init__(self, key, d=D, heads=HEADS, ff=FF):
    k1, k2, k3 = jax.random.split(key, 3)
    self.norm1 = eqx.nn.LayerNorm(d)
    self.attention = eqx.nn.MultiheadAttention(heads, d, key=k1)
    self.norm2 = eqx.nn.LayerNorm(d)
    self.w_in = eqx.nn.Linear(d, ff, key=k2)
    self.w_out = eqx.nn.Linear(ff, d, key=k3)

  def __call__(self, x):
    t = x.shape[0]
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h, mask=jnp.tril(jnp.ones((t, t), bool)))
    h = jax.vmap(self.norm2)(x)
    return x + jax.vmap(self.w_out)(jax.nn.gelu(jax.vmap(self.w_in)(h)))


class EqxStack(eqx.Module):
  """`layers` EqxBlocks made by `eqx.filter_vmap` (each array leaf stacked) and run by
  `lax.scan`, the way Equinox keeps a deep model's compile time flat; with `remat`, each
  layer under `eqx.filter_checkpoint`."""

  blocks: EqxBlock
  remat: bool = eqx.field(static=True)

  def __init__(self, key, layers=LAYERS, remat=False):
    self.blocks = eqx.filter_vmap(EqxBlock)(jax.random.split(key, layers))
    self.remat = remat

  def __call__(self, x):
    arrays, static = eqx.partition(self.blocks, eqx.is_array)

    def layer(block_arrays, x):
      return eqx.combine(block_arrays, static)(x)

    if self.remat:
      layer = eqx.filter_checkpoint(layer)
    x, _ = jax.lax.scan(lambda x, block_arrays: (layer(block_arrays, x), None), x, arrays)
    return x

"""Tiny decoder-only Transformers written the ordinary Flax way (Linen and NNX), with no
jaxquant in them, and the train steps the tests run them with.

Every GEMM is a Flax layer: the fused query/key/value projection a DenseGeneral (Linear
in NNX), the output projection an Einsum, the MLP and the head Dense. Kernels carry
logical axis names. Four GEMMs a block keep the quantized steps quick to compile.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxquant.flax as jqf

VOCAB, D_MODEL, HEADS, D_FF, SEQ, LAYERS, BATCH = 64, 32, 2, 64, 16, 2, 4
HEAD_DIM = D_MODEL // HEADS
DTYPE = jnp.bfloat16
# The GEMM modules of LinenLM by path; each emits input, weight and grad_output roles.
BLOCK_GEMMS = ("attention/qkv", "attention/out", "mlp/wi", "mlp/wo")
GEMM_PATHS = tuple(f"layer_{i}/{m}" for i in range(LAYERS) for m in BLOCK_GEMMS) + ("head",)
NNX_GEMM_PATHS = tuple(f"layers/{i}/{m}" for i in range(LAYERS) for m in BLOCK_GEMMS) + ("head",)


def _init(names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Attention(nn.Module):
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, x):
    qkv = nn.DenseGeneral(
      (3, HEADS, HEAD_DIM),
      dtype=self.dtype,
      name="qkv",
      kernel_init=_init(("embed", "qkv", "heads", "kv")),
    )(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    attended = nn.dot_product_attention(q, k, v, mask=mask, dtype=self.dtype)
    return nn.Einsum(
      (HEADS, HEAD_DIM, D_MODEL),
      "bshd,hdm->bsm",
      dtype=self.dtype,
      name="out",
      kernel_init=_init(("heads", "kv", "embed")),
    )(attended)


class Mlp(nn.Module):
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D_FF, dtype=self.dtype, name="wi", kernel_init=_init(("embed", "mlp")))(x)
    return nn.Dense(D_MODEL, dtype=self.dtype, name="wo", kernel_init=_init(("mlp", "embed")))(
      nn.gelu(h)
    )


class Block(nn.Module):
  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.dtype, name="attention")(nn.RMSNorm(dtype=self.dtype)(x))
    return x + Mlp(self.dtype, name="mlp")(nn.RMSNorm(dtype=self.dtype)(x))


class LinenLM(nn.Module):
  """tokens [batch, seq] -> logits [batch, seq, vocab] fp32; `dtype` is the compute dtype."""

  dtype: jnp.dtype = DTYPE

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(
      VOCAB, D_MODEL, dtype=self.dtype, name="embed", embedding_init=_init(("vocab", "embed"))
    )(tokens)
    for i in range(LAYERS):
      x = Block(self.dtype, name=f"layer_{i}")(x)
    x = nn.RMSNorm(dtype=self.dtype)(x)
    return nn.Dense(VOCAB, dtype=self.dtype, name="head", kernel_init=_init(("embed", "vocab")))(
      x
    ).astype(jnp.float32)


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return Block(name="block")(x), None


class ScannedLinenLM(nn.Module):
  """The layers under nn.scan of nn.remat, state stacked along a 'layers' axis."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D_MODEL, dtype=DTYPE, name="embed")(tokens)
    layers = nn.scan(
      nn.remat(ScanBlock),
      variable_axes={"params": 0, "quant_state": 0},
      split_rngs={"params": True},
      length=LAYERS,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = layers(name="layers")(x, None)
    return nn.Dense(VOCAB, dtype=DTYPE, name="head")(x).astype(jnp.float32)


# ---- NNX ----


class NnxAttention(nnx.Module):
  def __init__(self, rngs):
    self.qkv = nnx.Linear(D_MODEL, 3 * D_MODEL, dtype=DTYPE, rngs=rngs)
    self.out = nnx.Einsum(
      "bshd,hdm->bsm", (HEADS, HEAD_DIM, D_MODEL), (D_MODEL,), dtype=DTYPE, rngs=rngs
    )

  def __call__(self, x):
    qkv = self.qkv(x).reshape(*x.shape[:2], 3, HEADS, HEAD_DIM)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    return self.out(nnx.dot_product_attention(q, k, v, mask=mask, dtype=DTYPE))


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.wi = nnx.Linear(D_MODEL, D_FF, dtype=DTYPE, rngs=rngs)
    self.wo = nnx.Linear(D_FF, D_MODEL, dtype=DTYPE, rngs=rngs)

  def __call__(self, x):
    return self.wo(nnx.gelu(self.wi(x)))


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.attention_norm = nnx.RMSNorm(D_MODEL, dtype=DTYPE, rngs=rngs)
    self.attention = NnxAttention(rngs)
    self.mlp_norm = nnx.RMSNorm(D_MODEL, dtype=DTYPE, rngs=rngs)
    self.mlp = NnxMlp(rngs)

  def __call__(self, x):
    x = x + self.attention(self.attention_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class NnxLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D_MODEL, dtype=DTYPE, rngs=rngs)
    self.layers = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
    self.norm = nnx.RMSNorm(D_MODEL, dtype=DTYPE, rngs=rngs)
    self.head = nnx.Linear(D_MODEL, VOCAB, dtype=DTYPE, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.head(self.norm(x)).astype(jnp.float32)


class NnxScannedLM(nnx.Module):
  """The NNX layers stacked by nnx.vmap and run by nnx.scan of nnx.remat."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D_MODEL, dtype=DTYPE, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked_blocks(rngs):
      return NnxBlock(rngs)

    self.layers = stacked_blocks(rngs)
    self.head = nnx.Linear(D_MODEL, VOCAB, dtype=DTYPE, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def through_layers(x, block):
      return block(x)

    return self.head(through_layers(self.embed(tokens), self.layers)).astype(jnp.float32)


# ---- Data and train steps ----


def batch(seed=0, batch_size=BATCH):
  """A learnable batch: each row counts up from a random start (mod VOCAB)."""
  starts = jax.random.randint(jax.random.key(seed), (batch_size, 1), 0, VOCAB)
  return (starts + jnp.arange(SEQ + 1)) % VOCAB


def xent(logits, windows):
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def optimizer():
  return optax.adamw(1e-2)


# Plain gradient descent: an update proportional to the gradient, so fp32 noise in a
# gradient stays fp32 noise in the params (Adam's first steps are sign(gradient) steps,
# which turn a near-zero gradient's noise into a whole learning-rate step).
SGD = optax.sgd(0.5)


def linen_train_step(model, tx):
  """The README's Linen step: params and quant_state both differentiated; the state
  gradient carries the grad_output amaxes into `update_quant_state`."""

  def loss_fn(params, collections, windows, key):
    logits, updated = model.apply(
      {"params": params, **collections},
      windows[:, :-1],
      rngs={"quant": key},
      mutable=list(collections),
    )
    return xent(logits, windows), updated

  def step(params, opt_state, collections, windows, key):
    (loss, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, collections, windows, key)
    collections = jqf.update_quant_state(updated, state_grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, collections, loss

  return step


# XLA's own CPU optimization level (the suite runs at 0, tests/conftest.py): at 0 the CPU
# dot's summation order follows its operands' shapes, so a sharded step's fp32 sums part
# from the one-device step's; a test comparing those losses to fp32 noise compiles both at
# this level. Pairs, as jitted_linen_step's cache needs hashable arguments.
XLA_DEFAULT_OPT = (("xla_backend_optimization_level", 3),)


@functools.cache
def jitted_linen_step(model, tx=None, compiler_options=()):
  """One jitted train step per model (Linen modules compare by value), optimizer
  (default: `optimizer()`) and XLA compiler options ((name, value) pairs): tests that
  train the same model share its compiled step instead of compiling it again."""
  return jax.jit(
    linen_train_step(model, tx or optimizer()), compiler_options=dict(compiler_options) or None
  )


def linen_init(model, windows):
  variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), windows[:, :-1]))
  params = variables.pop("params")
  return params, variables


def train_linen(model, params, collections, steps, windows, tx=None, compiler_options=()):
  opt_state = (tx or optimizer()).init(params)
  step = jitted_linen_step(model, tx, compiler_options)
  losses = []
  for i in range(steps):
    params, opt_state, collections, loss = step(
      params, opt_state, collections, windows, jax.random.key(i)
    )
    losses.append(float(loss))
  return losses, (params, opt_state, collections)


def nnx_train_step(model, optimizer, windows):
  """The README's NNX step (use under nnx.jit)."""

  def loss_fn(model):
    return xent(model(windows[:, :-1]), windows)

  diff = nnx.DiffState(0, (nnx.Param, jqf.QuantState))
  loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
  jqf.update_quant_state(model, grads)
  optimizer.update(model, nnx.filter_state(grads, nnx.Param))
  return loss


# One nnx.jit for all tests: it compiles once per model graph (layers, recipe), and a
# test that trains an equal model again reuses that compilation.
jitted_nnx_step = nnx.jit(nnx_train_step)


def train_nnx(model, steps, windows):
  opt = nnx.Optimizer(model, optimizer(), wrt=nnx.Param)
  return [float(jitted_nnx_step(model, opt, windows)) for _ in range(steps)]

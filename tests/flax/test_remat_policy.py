"""`jaxquant.remat_policy` through Flax's remat: Linen's `nn.remat` over jaxquant's Dense
and over a stock model quantized by the swap-in, and `nnx.remat` over jaxquant's NNX
Linear. A pre-norm MLP block (RMSNorm, up, silu, down, residual add) under remat keeps
its GEMM inputs and weights as FP8 codes and nothing else but their scales and the output
silu reads, recomputes no cast and no GEMM, and has the gradients of the block without
remat, bit for bit."""

from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _remat_checks import backward_work, kept_bytes, saved_residuals
from flax import nnx

import jaxquant as jq
import jaxquant.flax as jqf
from jaxquant.flax import nnx as jqnnx

D, F, TOKENS = 128, 256, 128
RECIPE = "fp8_current"
FULL = jax.checkpoint_policies.nothing_saveable


class Block(nn.Module):
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    layer = lambda features, name: self.dense(
      features, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, name=name
    )
    h = layer(F, "up")(nn.RMSNorm(dtype=jnp.bfloat16, name="norm")(x))
    return x + layer(D, "down")(nn.silu(h))


class Model(nn.Module):
  dense: type = nn.Dense
  policy: Optional[Callable] = None  # None: no remat

  @nn.compact
  def __call__(self, x):
    block = Block if self.policy is None else nn.remat(Block, policy=self.policy)
    return block(self.dense, name="block")(x)


def _own_dense(*args, **kwargs):
  return jqf.linen.Dense(*args, recipe=RECIPE, **kwargs)


def _linen_models(policy, kind):
  """The block with jaxquant's Dense, or the stock block swapped in; `policy` None: no remat."""
  if kind == "own":
    return Model(_own_dense, policy)
  return jqf.quantize_model(Model(nn.Dense, policy), RECIPE)


def _x():
  return jax.random.normal(jax.random.key(0), (TOKENS, D), jnp.bfloat16)


def _probe(y):
  """A loss linear in y: its backward keeps nothing of y, so what is kept is the block's."""
  return jnp.sum(y.astype(jnp.float32))


def _linen_loss(model):
  def loss(params, x):
    return _probe(model.apply({"params": params}, x))

  return loss


def _assert_the_policy_keeps_codes_and_recomputes_nothing(loss, remat, full, args, bf16_bytes):
  without_remat = backward_work(loss, *args)
  assert backward_work(remat, *args) == without_remat
  assert backward_work(full, *args)["casts"] > without_remat["casts"]  # the criterion sees one
  kept = [r for r in saved_residuals(remat, *args) if not r.argument]
  for role in ("input", "weight"):  # up's and down's
    assert [r.dtype for r in kept if r.name == f"jaxquant.{role}_codes"] == ["f8_e4m3fn"] * 2
  # Nothing else but the scales and up's output (silu's input), in bf16: no norm output,
  # no silu product, no weight cast.
  others = [r for r in kept if r.name not in ("jaxquant.input_scales", "jaxquant.weight_scales")]
  assert [(r.name, r.dtype, r.shape) for r in others if "codes" not in (r.name or "")] == [
    ("jaxquant.output", "bf16", (TOKENS, F))
  ]
  assert kept_bytes(kept) < bf16_bytes


def _assert_same_gradients(loss, remat, args):
  """The quantized layers' gradients bit for bit; the norm scale's to fp32 rounding: the
  recomputed norm is fused into the sum over tokens of its gradient, which XLA then adds
  in another order (a stock model under JAX's own `everything_saveable` or
  `dots_saveable` differs alike; nothing of jaxquant's is recomputed)."""
  want, got = jax.jit(lambda *a: (jax.grad(loss)(*a), jax.grad(remat)(*a)))(*args)
  leaves = lambda tree: jax.tree_util.tree_flatten_with_path(tree)[0]
  for (path, g), (_, w) in zip(leaves(got), leaves(want), strict=True):
    if "norm" in jax.tree_util.keystr(path):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    else:
      np.testing.assert_array_equal(g, w)


def _linen_bf16_bytes():
  stock = Model(nn.Dense)
  params = stock.init(jax.random.key(1), _x())["params"]
  return kept_bytes(saved_residuals(_linen_loss(stock), params, _x()))


@pytest.mark.parametrize("kind", ["own", "swap"])
def test_linen_remat(kind):
  loss, remat, full = (_linen_loss(_linen_models(p, kind)) for p in (None, jq.remat_policy(), FULL))
  params = _linen_models(None, kind).init(jax.random.key(1), _x())["params"]
  args = (params, _x())
  _assert_the_policy_keeps_codes_and_recomputes_nothing(
    loss, remat, full, args, _linen_bf16_bytes()
  )
  _assert_same_gradients(loss, remat, args)


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    linear = lambda i, o, name: jqnnx.Linear(
      i, o, use_bias=False, dtype=jnp.bfloat16, recipe=RECIPE, name=name, rngs=rngs
    )
    self.norm = nnx.RMSNorm(D, dtype=jnp.bfloat16, rngs=rngs)
    self.up, self.down = linear(D, F, "up"), linear(F, D, "down")

  def __call__(self, x):
    return x + self.down(nnx.silu(self.up(self.norm(x))))


def _nnx_loss(policy):
  """loss(state, x) of the NNX block under nnx.remat (`policy` None: no remat)."""
  graphdef, _ = nnx.split(NnxBlock(nnx.Rngs(1)))

  def loss(state, x):
    block = nnx.merge(graphdef, state)
    call = NnxBlock.__call__ if policy is None else nnx.remat(NnxBlock.__call__, policy=policy)
    return _probe(call(block, x))

  return loss


def test_nnx_remat():
  loss, remat, full = (_nnx_loss(p) for p in (None, jq.remat_policy(), FULL))
  args = (nnx.split(NnxBlock(nnx.Rngs(1)))[1], _x())
  _assert_the_policy_keeps_codes_and_recomputes_nothing(
    loss, remat, full, args, _linen_bf16_bytes()
  )
  _assert_same_gradients(loss, remat, args)

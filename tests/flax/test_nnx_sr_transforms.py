"""Stochastic-rounding keys of NNX models under the transforms real decoders use.

MaxText-like decoders checkpoint each layer with `jax.checkpoint` over `nnx.split` /
`nnx.merge` or with `nnx.remat`; EasyDeL-like ones turn on gradient checkpointing
(`jax.checkpoint` of a function that merges graphdef and state); scanned ones stack the
layers with `nnx.vmap` and run them with `nnx.scan`. A key drawn inside such a trace must
not mutate a stream held outside it, and must still differ per layer, per call and per
step, and repeat for a fixed seed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxquant.flax as jqf
import jaxquant.flax.nnx as jqnnx
from jaxquant import recipes
from jaxquant.intercept import _contraction as contraction
from jaxquant.quantizers import NVFP4Quantizer

D = 32
LAYERS = 2

# Stochastic rounding on every operand, so a forward pass draws keys too.
SR_EVERYWHERE = recipes.CustomRecipe(
  lambda role: NVFP4Quantizer(stochastic_rounding=True), name="sr_everywhere"
)


class Block(nnx.Module):
  """A swapped stock layer and a weight contracted by the model's own code (routed)."""

  def __init__(self, rngs):
    self.proj = nnx.Linear(D, D, rngs=rngs)
    self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))

  def __call__(self, x):
    return jnp.einsum("bk,kn->bn", jax.nn.gelu(self.proj(x)), self.w[...])


def checkpoint_split_merge(layer, x):
  """MaxText's decoder: each layer checkpointed over nnx.split / nnx.merge."""
  graphdef, state = nnx.split(layer)
  return jax.checkpoint(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)


def nnx_remat(layer, x):
  return nnx.remat(lambda layer, x: layer(x))(layer, x)


def gradient_checkpointing(layer, x):
  """EasyDeL's gradient checkpointing: jax.checkpoint of a function merging graphdef
  and state, the graphdef bound outside."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

  def run(graphdef, params, rest, x):
    return nnx.merge(graphdef, params, rest)(x)

  return jax.checkpoint(functools.partial(run, graphdef))(params, rest, x)


def closed_over(layer, x):
  """jax.checkpoint of a closure over the layer: its variables live outside the trace."""
  return jax.checkpoint(lambda x: layer(x))(x)


class Decoder(nnx.Module):
  def __init__(self, rngs, run_layer):
    self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.run_layer = run_layer

  def __call__(self, x):
    for layer in self.layers:
      x = self.run_layer(layer, x)
    return x


class ScannedDecoder(nnx.Module):
  """Layers stacked by nnx.vmap, run by nnx.scan of nnx.remat."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return Block(rngs)

    self.layers = stacked(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def through(x, block):
      return block(x)

    return through(x, self.layers)


RUNS = {
  "checkpoint_split_merge": checkpoint_split_merge,
  "nnx_remat": nnx_remat,
  "gradient_checkpointing": gradient_checkpointing,
  "closed_over": closed_over,
}


def quantized(make, recipe=recipes.nvfp4, seed=1):
  return jqf.quantize_model(make(nnx.Rngs(0)), recipe, rngs=nnx.Rngs(quant=seed))


def inputs():
  return jax.random.normal(jax.random.key(3), (32, D))


def loss(model, x):
  return jnp.mean(model(x) ** 2)


@pytest.fixture
def drawn_keys(monkeypatch):
  """[(role name, key bits)] of every quantized GEMM, in the order they ran."""
  drawn = []
  original = contraction.quantized_gemm

  def spy(*args, name, key, **kwargs):
    if key is not None:
      jax.debug.callback(
        lambda bits, name=name: drawn.append((name, tuple(np.asarray(bits).ravel()))),
        jax.random.key_data(key),
      )
    return original(*args, name=name, key=key, **kwargs)

  monkeypatch.setattr(contraction, "quantized_gemm", spy)
  return drawn


@pytest.mark.slow  # over 10 s: run under the newest JAX only
@pytest.mark.parametrize("run", list(RUNS), ids=str)
def test_forward_and_grad_under_checkpointed_layers(run):
  model = quantized(lambda rngs: Decoder(rngs, RUNS[run]))
  x = inputs()
  y = model(x)
  grads = nnx.grad(loss)(model, x)
  assert np.all(np.isfinite(y))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert np.any(np.asarray(grads["layers"][0]["w"][...]) != 0)


@pytest.mark.slow  # over 10 s: run under the newest JAX only
def test_scanned_layers_forward_and_grad():
  model = quantized(ScannedDecoder)
  x = inputs()
  grads = nnx.grad(loss)(model, x)
  assert np.all(np.isfinite(model(x)))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_own_layers_holding_the_stream_outside_the_trace():
  """jaxquant's own layers, their `quant_rngs` shared with the model, checkpointed as a
  closure: the stream is not the trace's to mutate."""
  quant_rngs = nnx.Rngs(quant=4)
  layers = [
    jqnnx.Linear(D, D, recipe=SR_EVERYWHERE, name=f"l{i}", quant_rngs=quant_rngs, rngs=nnx.Rngs(i))
    for i in range(LAYERS)
  ]

  def forward(x):
    for layer in layers:
      x = closed_over(layer, x)
    return x

  assert np.all(np.isfinite(forward(inputs())))


@pytest.mark.parametrize("run", ["checkpoint_split_merge", "nnx_remat"], ids=str)
def test_keys_differ_per_layer_call_and_step_and_repeat_per_seed(drawn_keys, run):
  def two_steps(seed):
    drawn_keys.clear()
    model = quantized(lambda rngs: Decoder(rngs, RUNS[run]), SR_EVERYWHERE, seed)
    x = inputs()
    steps = []
    for _ in range(2):
      model(x)
      steps.append(list(drawn_keys))
      drawn_keys.clear()
    return steps

  first, second = two_steps(seed=1)
  # Per layer, per GEMM: layers/0/proj, layers/0/w, layers/1/proj, layers/1/w.
  assert len(first) == 2 * LAYERS, first
  assert len({bits for _, bits in first}) == len(first), first
  assert not {bits for _, bits in first} & {bits for _, bits in second}
  again_first, _ = two_steps(seed=1)
  assert again_first == first
  other_seed, _ = two_steps(seed=2)
  assert not {bits for _, bits in other_seed} & {bits for _, bits in first}


def test_keys_differ_between_calls_within_a_step(drawn_keys):
  """One layer called twice under one checkpoint draws two keys."""

  class Twice(nnx.Module):
    def __init__(self, rngs):
      self.block = Block(rngs)

    def __call__(self, x):
      return checkpoint_split_merge(nnx.Sequential(self.block, self.block), x)

  quantized(Twice, SR_EVERYWHERE)(inputs())
  assert len(drawn_keys) == 4, drawn_keys
  assert len({bits for _, bits in drawn_keys}) == 4, drawn_keys


def test_scanned_layers_draw_a_key_each(drawn_keys):
  """The swapped layers of a scanned stack share a role name and a trace: each folds in
  its index in the stack. (Weights the scanned code contracts itself share their keys
  across the stack: nothing in the trace tells their layers apart.)"""
  model = quantized(ScannedDecoder, SR_EVERYWHERE)
  model(inputs())
  swapped = [bits for name, bits in drawn_keys if name == "layers/proj"]
  assert len(swapped) == LAYERS, drawn_keys
  assert len(set(swapped)) == LAYERS, drawn_keys

"""Train a byte-level GPT written in plain JAX (a params dict, `jnp.einsum` attention, its
layers run by `lax.scan`; no Flax) under `jaxquant.quantize` and each recipe, and compare.

The main example's setting in miniature (examples/train_lm.py): the corpus is this
interpreter's standard library sources as byte tokens (examples/lm/data.py), and every
recipe starts from the same params and sees the same batches in the same order, so the
validation-loss gaps between recipes come from the number formats alone. The logits head
stays in bf16, as in the main example; delayed scaling's state and stochastic rounding's
keys go through the train step explicitly (docs/functions.md).

  python examples/train_plain_jax.py                    # bf16, fp8_current, fp8_delayed, mxfp8
  python examples/train_plain_jax.py --recipes all --steps 300
  python examples/train_plain_jax.py --recipes bf16,mxfp8 --report   # + mxfp8's swap report
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from lm import data

import jaxquant
from jaxquant import functional as jqfn
from jaxquant import recipes

DEFAULT_RECIPES = ("bf16", "fp8_current", "fp8_delayed", "mxfp8")


def init_params(key, *, d_model, heads, layers, ff, seq_len, vocab=data.VOCAB_SIZE):
  keys = iter(jax.random.split(key, 8))
  normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) / math.sqrt(fan_in)
  head_dim = d_model // heads
  return {
    "wte": normal((vocab, d_model), 1) * 0.02,
    "wpe": normal((seq_len, d_model), 1) * 0.02,
    "layers": {  # each param stacked over the layers, one slice per scan step
      "ln1": jnp.ones((layers, d_model)),
      "w_qkv": normal((layers, d_model, 3, heads, head_dim), d_model),
      "w_o": normal((layers, heads, head_dim, d_model), d_model),
      "ln2": jnp.ones((layers, d_model)),
      "w_in": normal((layers, d_model, ff), d_model),
      "w_out": normal((layers, ff, d_model), ff),
    },
    "ln_f": jnp.ones((d_model,)),
    "head": normal((d_model, vocab), d_model),
  }


def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * scale


def block(x, layer):
  t = x.shape[1]
  h = rms_norm(x, layer["ln1"]).astype(jnp.bfloat16)
  q, k, v = jnp.einsum("btd,dkhe->kbthe", h, layer["w_qkv"].astype(jnp.bfloat16))
  scores = jnp.einsum("bthe,bshe->bhts", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((t, t), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(jnp.bfloat16)
  attended = jnp.einsum("bhts,bshe->bthe", probs, v)
  x = x + jnp.einsum("bthe,hed->btd", attended, layer["w_o"].astype(jnp.bfloat16))
  h = rms_norm(x, layer["ln2"]).astype(jnp.bfloat16)
  hidden = jax.nn.gelu(h @ layer["w_in"].astype(jnp.bfloat16))
  return x + (hidden @ layer["w_out"].astype(jnp.bfloat16)).astype(jnp.float32)


def gpt(params, tokens):
  """Logits [B, T, vocab] of byte tokens [B, T]."""
  x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
  x, _ = jax.lax.scan(lambda x, layer: (block(x, layer), None), x, params["layers"])
  return rms_norm(x, params["ln_f"]) @ params["head"]


def cross_entropy(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def head_in_bf16(preset: recipes.CustomRecipe) -> recipes.CustomRecipe:
  """The preset with the logits head kept in high precision (its role is the param's path),
  its other settings (backward, fast accumulation, tiny GEMMs) the preset's."""
  qfactory = lambda role: None if role.name == "head" else preset.quantizer(role)
  return dataclasses.replace(preset, qfactory=qfactory)


def train(qgpt, params, batches, validation, steps, lr):
  """(train losses, validation loss, seconds per step after the first) of `steps` steps."""
  first = next(batches)
  state = qgpt.init(params, jnp.asarray(first[:, :-1]))
  tx = optax.adamw(lr, weight_decay=0.01)
  opt_state = tx.init(params)

  def loss_fn(params, state, windows, key):
    logits, new_state = qgpt.apply(params, windows[:, :-1], state=state, rng=key)
    return cross_entropy(logits, windows[:, 1:]), new_state

  @jax.jit
  def step(params, opt_state, state, windows, key):
    (loss, new_state), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, state, windows, key)
    finite = jnp.isfinite(loss) & jqfn.recorded_amaxes_finite(new_state, state_grads)
    grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    state = jqfn.update_quant_state(new_state, state_grads, finite=finite)
    return optax.apply_updates(params, updates), opt_state, state, loss

  evaluate = jax.jit(lambda params, state, windows: loss_fn(params, state, windows, None)[0])
  losses, windows, started = [], first, time.perf_counter()
  for i in range(steps):
    params, opt_state, state, loss = step(params, opt_state, state, windows, jax.random.key(i))
    losses.append(float(loss))
    if i == 0:
      started = time.perf_counter()  # the first step compiles
    windows = next(batches)
  per_step = (time.perf_counter() - started) / max(steps - 1, 1)
  val = float(np.mean([evaluate(params, state, jnp.asarray(w)) for w in validation]))
  return losses, val, per_step


def main(argv=None) -> dict[str, float]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="presets, or all")
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--eval-batches", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--report", action="store_true", help="print each recipe's swap report")
  args = parser.parse_args(argv)
  names = list(recipes.PRESETS) if args.recipes == "all" else args.recipes.split(",")
  unknown = [n for n in names if n not in recipes.PRESETS]
  if unknown:
    parser.error(f"unknown recipes {unknown}; the presets are {list(recipes.PRESETS)}")

  corpus = data.load_corpus()
  validation = data.fixed_validation_batches(
    corpus.validation, args.seed, args.eval_batches, args.batch, args.seq_len
  )
  params = init_params(
    jax.random.key(args.seed),
    d_model=args.d_model,
    heads=args.heads,
    layers=args.layers,
    ff=4 * args.d_model,
    seq_len=args.seq_len,
  )
  print(
    f"{corpus.train.size:,} train bytes; GPT d={args.d_model}, {args.layers} layers, "
    f"{sum(p.size for p in jax.tree.leaves(params)):,} params; {args.steps} steps of "
    f"{args.batch} x {args.seq_len} tokens on {jax.default_backend()}"
  )
  results = {}
  for name in names:
    qgpt = jaxquant.quantize(gpt, head_in_bf16(recipes.PRESETS[name]))
    if args.report:
      print(jqfn.swap_report(qgpt, params, jnp.asarray(validation[0][:, :-1])))
    batches = data.train_batches(corpus.train, args.seed, args.batch, args.seq_len)
    losses, val, per_step = train(qgpt, params, batches, validation, args.steps, args.lr)
    results[name] = val
    gap = f", {val - results['bf16']:+.4f} vs bf16" if name != "bf16" and "bf16" in results else ""
    print(
      f"{name:>12}: train loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}, validation "
      f"{val:.4f}{gap}, {per_step * 1e3:.0f} ms/step"
    )
  return results


if __name__ == "__main__":
  main()

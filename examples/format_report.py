"""Quantizes real tensors with outlier channels by every preset and prints where the
formats differ: the round-trip error on the outlier channels and on the rest, the share of
nonzero values flushed to zero, and the stored bytes.

The tensors (no download):
- `activation`: the input of the example model's last MLP down projection (the GELU
  output, the heaviest-tailed GEMM input of the model: its largest values are tens of
  times its median), after `--steps` Adam steps of the example LM on the standard
  library's sources (`examples/lm`, a small config; about 100 s of CPU time);
- `bigram`: the byte-bigram counts of the standard library's sources, rows the first
  byte, a row per "token" and a column per "channel": a few bytes (space, newline, `e`)
  follow millions of times, most a handful, so a few channels dwarf the rest.

Each preset's input-role quantizer quantizes the tensor for the rowwise usage (blocks
along the channels, as the GEMM's input is quantized for fprop) and the columnwise one;
delayed scaling with a history that has seen the tensor once.
The "outlier" channels are the 2% whose largest magnitude is highest.

    python examples/format_report.py [--tensor activation|bigram|both] [--steps N]
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from lm import data
from lm.model import ModelConfig, TransformerLM

import jaxquant
from jaxquant.quantizers import for_usage
from jaxquant.roles import QuantizerRole

OUTLIER_SHARE = 0.02
# Small enough for about 100 s of CPU time, deep enough that the last layer's MLP sees trained
# residual-stream features.
MODEL = ModelConfig(seq_len=128, d_model=128, n_layers=2, n_heads=4, d_ff=512)


def trained_mlp_activation(steps: int, batch_size: int = 16, seed: int = 0) -> np.ndarray:
  """[tokens, d_ff] fp32: the last layer's `mlp/wo` input after `steps` Adam steps."""
  corpus = data.load_corpus()
  batches = data.train_batches(corpus.train, seed, batch_size, MODEL.seq_len)
  model = TransformerLM(MODEL)
  params = nn.unbox(model.init(jax.random.key(seed), next(batches)[:, :-1]))["params"]
  optimizer = optax.adamw(3e-3, weight_decay=0.1)
  opt_state = optimizer.init(params)

  def loss_fn(params, windows):
    logits = model.apply({"params": params}, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

  @jax.jit
  def step(params, opt_state, windows):
    grads = jax.grad(loss_fn)(params, windows)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(steps):
    params, opt_state = step(params, opt_state, jnp.asarray(next(batches)))

  last_mlp_out = ("decoder", f"layer_{MODEL.n_layers - 1}", "mlp", "wo")
  captured = {}

  def capture(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and tuple(context.module.path) == last_mlp_out:
      captured["x"] = args[0]
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(capture):
    model.apply({"params": params}, jnp.asarray(next(batches)[:, :-1]))
  x = np.asarray(captured["x"], np.float32)
  return x.reshape(-1, x.shape[-1])


def bigram_counts(max_files: int = 200) -> np.ndarray:
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  counts = np.zeros((256, 256), np.float64)
  for path in sorted(stdlib.glob("*.py"))[:max_files]:
    tokens = np.frombuffer(path.read_bytes(), np.uint8)
    np.add.at(counts, (tokens[:-1], tokens[1:]), 1.0)
  return counts


def stored_bytes(qt: jaxquant.QuantizedTensor) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(qt))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def report(title: str, x32: np.ndarray) -> None:
  x = jnp.asarray(x32, jnp.bfloat16)
  want = np.asarray(x, np.float32)
  channel_max = np.abs(want).max(axis=0)
  outliers = channel_max >= np.quantile(channel_max, 1 - OUTLIER_SHARE)
  median = float(np.median(channel_max))
  print(
    f"\n{title}: shape {x.shape}; {int(outliers.sum())} outlier channels, their largest "
    f"value {float(channel_max[outliers].min()) / median:.3g}-"
    f"{float(channel_max.max()) / median:.3g}x the median channel's"
  )
  print(
    f"{'preset':<12} {'usage':<10} {'error: all':>10} {'outliers':>9} {'the rest':>9} "
    f"{'flushed':>8} {'bytes vs bf16':>13}"
  )
  nonzero = want != 0
  for name, recipe in jaxquant.recipes.PRESETS.items():
    q = recipe.quantizer(QuantizerRole("linear", "input", "report"))
    if q is None:
      continue
    if jaxquant.quantizers.needs_state(q):
      # Delayed scaling in its steady state: the scale from a history that has recorded
      # this tensor's amax once (a fresh state's scale of 1 would saturate a tensor whose
      # values pass the format's largest).
      rowwise = for_usage(q, "rowwise")
      _, seen = jaxquant.reference.quantize(x, q, state=jaxquant.scaling.init_state(rowwise))
      qt, _ = jaxquant.reference.quantize(x, q, state=jaxquant.scaling.update(seen, rowwise))
    else:
      qt = jaxquant.reference.quantize(x, q, key=jax.random.key(0))
    ratio = stored_bytes(qt) / (2 * x.size * 2)  # against both usages in bf16
    for usage in ("rowwise", "columnwise"):
      got = np.asarray(jaxquant.reference.dequantize(qt, usage, jnp.float32))
      target = want
      if getattr(for_usage(q, usage), "rht", False) and usage == "columnwise":
        # RHT data lives in the Hadamard domain; compare against the transformed tensor.
        target = np.asarray(jaxquant.reference.apply_rht(x.astype(jnp.float32).T, jnp.bfloat16).T)
      flushed = float(np.mean((got == 0) & nonzero) / np.mean(nonzero))
      print(
        f"{name:<12} {usage:<10} {relative_error(got, target):>10.2e} "
        f"{relative_error(got[:, outliers], target[:, outliers]):>9.2e} "
        f"{relative_error(got[:, ~outliers], target[:, ~outliers]):>9.2e} "
        f"{flushed:>8.1%} {ratio:>13.2f}"
      )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tensor", choices=("activation", "bigram", "both"), default="both")
  parser.add_argument("--steps", type=int, default=300, help="Adam steps before the capture")
  args = parser.parse_args()
  if args.steps < 1:
    parser.error(f"--steps must be at least 1, got {args.steps}")
  if args.tensor in ("activation", "both"):
    report(
      f"the example LM's last mlp/wo input after {args.steps} steps",
      trained_mlp_activation(args.steps),
    )
  if args.tensor in ("bigram", "both"):
    report("standard-library byte-bigram counts", bigram_counts())


if __name__ == "__main__":
  main()

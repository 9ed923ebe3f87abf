"""What a quantized train step's compile time is spent on: step.py's step compiled alone,
as it is and with one suspect taken out.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 benchmarks/compile_probe.py \\
        [--shape 1b] [--layers 2] [--only NAMES] [--repeats 2]

For each variant (step_variants: bf16, the presets, the peers) the train step of step.py is
traced, lowered and compiled from abstract arguments `--repeats` times and the fastest
compile is printed (the first also pays for bf16's GEMM autotuning, later ones hit XLA's
autotuning cache). Then, for the variants a suspect applies to, the same with it removed.
These are diagnostics, not recipes: without a suspect the step computes something else.

- `delayed_update`: the delayed-scaling state is carried to the next step as the forward
  pass left it, not advanced by `update_quant_state` (variants with delayed scaling);
- `role_keys`: jaxquant's per-role stochastic-rounding keys are the module's key itself,
  not `fold_in(key, role)` (variants that round stochastically);
- `fold_in`: no `jax.random.fold_in` at all, Flax's `make_rng` included (the same variants).

Prints one line per (variant, suspect) and writes no result file.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import jax
import jax.numpy as jnp
import optax
import step
import step_variants
from step_model import SHAPES, DecoderStack

from jaxquant.ops import _dense as ops_dense
from jaxquant.ops import _grouped_dense as ops_grouped_dense

TOKENS = {"8b": (4, 4096), "1b": (4, 4096), "tiny": (1, 256)}


def _keep_state(variant):
  return step_variants.Variant(variant.name, variant.model, step_variants._keep)


@contextlib.contextmanager
def _module_key_for_every_role():
  same = lambda key, tensor_type: key
  with contextlib.ExitStack() as stack:
    for module in (ops_dense, ops_grouped_dense):
      stack.enter_context(mock.patch.object(module, "role_key", same))
    yield


@contextlib.contextmanager
def _no_fold_in():
  with mock.patch.object(jax.random, "fold_in", lambda key, data: key):
    yield


# name: (variant -> variant, context while tracing)
SUSPECTS = {
  "delayed_update": (_keep_state, contextlib.nullcontext),
  "role_keys": (lambda variant: variant, _module_key_for_every_role),
  "fold_in": (lambda variant: variant, _no_fold_in),
}


class Probe:
  """One shape's stock model, its parameters and abstract step arguments."""

  def __init__(self, shape_name: str, layers: int, attention: str):
    shape = SHAPES[shape_name]
    self.stock = DecoderStack(shape, layers, attention=attention)
    self.stock_params = step.init_variables(self.stock, shape.d_model)["params"]
    self.tx = optax.adamw(1e-4)
    self.params = self._abstract(self.stock_params)
    self.opt_state = jax.eval_shape(self.tx.init, self.params)
    self.x = jax.ShapeDtypeStruct((*TOKENS[shape_name], shape.d_model), jnp.bfloat16)

  @staticmethod
  def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

  def _args(self, variant):
    collections = step.variant_collections(variant, self.stock_params, self.stock.shape.d_model)
    return self.params, self.opt_state, self._abstract(collections), self.x, jax.random.key(0)

  def applies(self, suspect: str, variant) -> bool:
    """Whether the variant has the suspect at all: delayed-scaling state, or keys to fold."""
    if suspect == "delayed_update":
      return bool(self._args(variant)[2])
    args, folds = self._args(variant), []  # init folds in the params keys: outside the count
    jax.clear_caches()  # cached helper traces would hide their fold_ins from the count
    fold_in = jax.random.fold_in
    counting = lambda key, data: folds.append(data) or fold_in(key, data)
    with mock.patch.object(jax.random, "fold_in", counting):
      jax.jit(step.train_step(variant, self.tx)).trace(*args)
    return bool(folds)

  def fastest_compile_s(self, variant, repeats: int, context=contextlib.nullcontext) -> float:
    """The fastest of `repeats` compiles (tracing and lowering included), each traced
    within `context`."""
    args = self._args(variant)
    # Traces of jitted helpers are cached by function: ones made with another suspect
    # removed (or none) would otherwise come back instead of being traced in `context`.
    jax.clear_caches()
    times = []
    for _ in range(repeats):
      with context():
        start = time.perf_counter()
        jax.jit(step.train_step(variant, self.tx)).lower(*args).compile()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="1b", choices=sorted(TOKENS))
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument(
    "--only",
    default=",".join(step_variants.ORDER),
    help="comma-separated variants (step_variants.ORDER)",
  )
  parser.add_argument(
    "--suspects", default=",".join(SUSPECTS), help=f"comma-separated, of {list(SUSPECTS)}"
  )
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args(argv)
  attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  step.warm_backend(argparse.Namespace(attention=attention))
  probe = Probe(args.shape, args.layers, attention)
  suspects = [s for s in args.suspects.split(",") if s]
  for name in [n for n in args.only.split(",") if n]:
    try:
      variant = step_variants.build(name, probe.stock)
    except ImportError as error:
      print(f"{name}: skipped ({error})")
      continue
    print(
      f"{name:18s} {'':22s} {probe.fastest_compile_s(variant, args.repeats):6.2f} s", flush=True
    )
    for suspect in suspects:
      if not probe.applies(suspect, variant):
        continue
      change_variant, context = SUSPECTS[suspect]
      seconds = probe.fastest_compile_s(change_variant(variant), args.repeats, context)
      print(f"{name:18s} without {suspect:14s} {seconds:6.2f} s", flush=True)


if __name__ == "__main__":
  main()

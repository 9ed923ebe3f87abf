"""MoE train-step benchmark: one MoE block's full step as users write it, against jaxquant.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/moe_step.py \
        [--shapes fine,coarse] [--only NAMES | --skip NAMES] [--deadline-s S] \
        [--profile DIR] [--quick] [--out FILE]

The block (moe_model.py): RMSNorm, router, top-k, the expert SwiGLU MLP over one
[E, d, 2f] and one [E, f, d] param, weighted combine, residual; T tokens of random bf16
activations, loss the mean square of the output, AdamW, params fp32. Variants, in one
process, from the same params and optimizer state:

- `bf16_ragged`: the experts as stock `jax.lax.ragged_dot` (XLA's).
- `bf16_padded`: padded dispatch, capacity factor 1.25, experts as batched einsums.
- `jaxquant_grouped_bf16`: the ragged model with `jaxquant.ops.grouped_dense` (no
  quantization) as its ragged dot: jaxquant's own grouped path, unquantized.
- `ragged/<preset>`, `padded/<preset>`: `jaxquant.flax.quantize_model(model, preset)` of
  either model, for every preset but bf16 (which runs the stock code).
- `moe_module/<preset>`: RMSNorm + `jaxquant.flax.MoE` (three GroupedDense experts, its own
  router and params) + residual, under fp8_current and bf16.
- `qwix_fp8_tensor`: Qwix's quantized training (`QtProvider`, E4M3 forward, E5M2
  gradients, per-tensor scales) of the ragged model: Qwix intercepts `ragged_dot`.

The best bf16 is the faster of `bf16_ragged` and `bf16_padded`; the best peer is Qwix.
Each variant is compiled once (`compile_s`: trace, lower, compile) and then timed under
balanced routing (the router's own at random init) and skewed routing (a fixed
Dirichlet-skewed bias on the router's logits, moe_model.skewed_route_bias): one
executable, two inputs. All variants and both routings take interleaved turns
(timing.py). Records per (variant, shape), merged into
benchmarks/results/<gpu>/moe_step.json: `step_ms` and `skewed_step_ms` (medians),
`skewed_vs_balanced` (step time ratio), `speedup_vs_bf16` (against the best bf16 variant,
named in the record's `baseline`, and the `_lowest_round` of the per-round ratios),
`speedup_vs_best_peer` (against Qwix), `expert_tflops` (the routed pairs' expert-GEMM
FLOPs of a step over the step's time: a lower bound on the GEMMs' own rate),
`peak_gib` (XLA's memory analysis of the step) with `peak_vs_bf16`, `compile_s` with
`compile_vs_bf16`.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import time
import types

import jax
import jax.numpy as jnp
import optax
import step as step_benchmark
from moe_model import SHAPES, JaxquantMoEBlock, MoEBlock, skewed_route_bias
from records import ResultFile, results_path
from step import Clock, memory_gib
from timing import Call, interleaved_seconds, speedup

import jaxquant.flax as jqf
from jaxquant import kernels, ops, recipes

QUANTIZED_PRESETS = tuple(p for p in recipes.PRESETS if p != "bf16")
BF16_VARIANTS = ("bf16_ragged", "bf16_padded")
PEER = "qwix_fp8_tensor"
# Compiled and timed in this order: the baseline, the headline recipes and the peer first,
# so that a run cut short by its deadline keeps the comparisons that matter most; XLA's
# ragged_dot after them, its compile the longest of the bf16 variants (its autotuning
# has asked for more memory than an H100 holds at the fine shape).
ORDER = (
  "bf16_padded",
  "jaxquant_grouped_bf16",
  "ragged/fp8_current",
  PEER,
  "ragged/fp8_delayed",
  "padded/fp8_current",
  "padded/fp8_delayed",
  "bf16_ragged",
  "ragged/fp8_block",
  "ragged/mxfp8",
  "moe_module/fp8_current",
  "moe_module/fp8_delayed",
  "moe_module/bf16",
  "padded/fp8_block",
  "padded/mxfp8",
  *(f"{d}/{p}" for p in ("nvfp4", "hybrid") for d in ("ragged", "padded")),
)
assert set(ORDER) >= {f"{d}/{p}" for d in ("ragged", "padded") for p in QUANTIZED_PRESETS}


def grouped_dense_bf16(x, w, sizes):
  """jaxquant's grouped path, nothing quantized, in ragged_dot's place."""
  return ops.grouped_dense(x, w, sizes, recipe=recipes.bf16)


def build_model(name: str, shape):
  """(model, how its train step carries its collections to the next step)."""
  keep = lambda collections, state_grads: collections
  if name == "bf16_ragged":
    return MoEBlock(shape, "ragged"), keep
  if name == "bf16_padded":
    return MoEBlock(shape, "padded"), keep
  if name == "jaxquant_grouped_bf16":
    return MoEBlock(shape, "ragged", ragged_dot=grouped_dense_bf16), keep
  if name == PEER:
    import qwix  # optional, benchmark-only

    rule = qwix.QtRule(
      module_path=".*",
      weight_qtype=jnp.float8_e4m3fn,
      act_qtype=jnp.float8_e4m3fn,
      bwd_qtype=jnp.float8_e5m2,
      disable_channelwise_axes=True,
    )
    return qwix.quantize_model(MoEBlock(shape, "ragged"), qwix.QtProvider([rule])), keep
  dispatch, preset = name.split("/")
  if dispatch == "moe_module":
    return JaxquantMoEBlock(shape, recipes.get(preset)), jqf.update_quant_state
  return jqf.quantize_model(MoEBlock(shape, dispatch), recipes.get(preset)), jqf.update_quant_state


def train_step(model, advance, tx):
  def loss_fn(params, collections, x, route_bias, key):
    y, updated = model.apply(
      {"params": params, **collections},
      x,
      route_bias,
      rngs={"quant": key},
      mutable=list(collections),
    )
    return jnp.mean(jnp.square(y.astype(jnp.float32))), updated

  def step(params, opt_state, collections, x, route_bias, key):
    (loss, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, collections, x, route_bias, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, advance(updated, state_grads), loss

  return step


class Prepared:
  """One variant compiled, warmed up, and its balanced and skewed calls."""

  def __init__(self, name, shape, inputs, tx, stock, warmup_steps):
    self.name = name
    model, advance = build_model(name, shape)
    x, balanced, skewed, key = inputs
    start = time.perf_counter()
    params, opt_state, variables = variables_for(model, stock, tx, inputs)
    init_s = time.perf_counter() - start
    step = train_step(model, advance, tx)
    args = (params, opt_state, variables, x, balanced, key)
    start = time.perf_counter()
    self.executable = jax.jit(step).lower(*args).compile()
    self.compile_s = time.perf_counter() - start
    self.peak_gib = memory_gib(self.executable)
    start = time.perf_counter()
    collections, loss = variables, None
    for _ in range(warmup_steps):  # carries the collections (delayed scaling's state) on
      _, _, collections, loss = self.executable(params, opt_state, collections, x, balanced, key)
    loss = float(loss)
    self.step_estimate_s = (time.perf_counter() - start) / warmup_steps
    self.calls = {
      routing: Call(self.executable, (params, opt_state, collections, x, bias, key))
      for routing, bias in (("balanced", balanced), ("skewed", skewed))
    }
    peak = "" if self.peak_gib is None else f", XLA memory {self.peak_gib:.2f} GiB"
    print(
      f"  {name}: init {init_s:.1f} s, compiled in {self.compile_s:.1f} s{peak}; "
      f"warm-up {self.step_estimate_s * 1e3:.1f} ms/step, loss {loss:.4g}",
      flush=True,
    )
    if loss != loss or abs(loss) == float("inf"):
      raise FloatingPointError(f"{name}: loss {loss} after {warmup_steps} warm-up steps")


def variables_for(model, stock, tx, inputs):
  """(params, optimizer state, other collections) of a variant: the stock model's params
  and optimizer state where the variant's param tree is theirs (every variant trains the
  same parameters), its own init otherwise (jaxquant's MoE module); a real init only where
  the variant holds collections besides params (delayed scaling's state)."""
  x, balanced, _, key = inputs
  rngs = {"params": jax.random.key(0), "quant": key}
  shapes = jax.eval_shape(model.init, rngs, x, balanced)
  same_params = jax.tree.structure(shapes["params"]) == jax.tree.structure(stock[0])
  if same_params and set(shapes) == {"params"}:
    return stock[0], stock[1], {}
  variables = dict(jax.jit(model.init)(rngs, x, balanced))
  params = variables.pop("params")
  if same_params:
    return stock[0], stock[1], variables
  return params, jax.jit(tx.init)(params), variables


def prepare_shape(shape_name, names, args, clock):
  shape = SHAPES[shape_name]
  tx = optax.adamw(1e-4)
  x = jax.random.normal(jax.random.key(2), (shape.tokens, shape.d_model), jnp.bfloat16)
  balanced = jnp.zeros((shape.experts,), jnp.float32)
  skewed = jnp.asarray(skewed_route_bias(shape.experts))
  inputs = (x, balanced, skewed, jax.random.key(3))
  params = jax.jit(MoEBlock(shape).init)(jax.random.key(0), x, balanced)["params"]
  stock = (params, jax.jit(tx.init)(params))
  prepared = {}
  for name in names:
    compiles = [p.compile_s for p in prepared.values()]
    needed = (max(compiles) if compiles else 0.0) * 1.5 + 10 * len(prepared)
    if not clock.fits(needed):
      print(f"  {name}: skipped, the deadline ({needed:.0f} s more needed)", flush=True)
      continue
    print(f"  {name}: compiling at {clock.elapsed():.0f} s", flush=True)
    try:  # one variant that fails costs only itself
      prepared[name] = Prepared(name, shape, inputs, tx, stock, args.warmup_steps)
    except Exception as error:
      print(f"  {name}: FAILED, not recorded: {type(error).__name__}: {str(error)[:1500]}")
  return prepared


def record_shape(results, shape_name, prepared, args):
  shape = SHAPES[shape_name]
  calls = {
    (name, routing): call for name, p in prepared.items() for routing, call in p.calls.items()
  }
  samples = interleaved_seconds(calls, reps=args.reps, rounds=args.rounds, warmup_s=args.warmup_s)
  median = lambda name, routing="balanced": statistics.median(samples[name, routing])
  bf16 = [n for n in BF16_VARIANTS if n in prepared]
  best_bf16 = min(bf16, key=median, default=None)
  print(f"best bf16 at {shape_name}: {best_bf16}")

  def add(name, metric, value, **extra):
    print(f"{name:<24} {shape_name:<7} {metric:<32} {value:9.3f}", flush=True)
    results.add(f"moe_{name}", shape_name, metric, value, **extra)

  for name, p in prepared.items():
    add(name, "step_ms", median(name) * 1e3)
    add(name, "skewed_step_ms", median(name, "skewed") * 1e3)
    add(name, "skewed_vs_balanced", median(name, "skewed") / median(name))
    for base, metric in ((best_bf16, "speedup_vs_bf16"), (PEER, "speedup_vs_best_peer")):
      if base in prepared and base != name:
        for routing, prefix in (("balanced", ""), ("skewed", "skewed_")):
          value, lowest = speedup(samples[base, routing], samples[name, routing])
          add(name, prefix + metric, value, baseline=base)
          add(name, f"{prefix}{metric}_lowest_round", lowest, baseline=base)
    add(name, "expert_tflops", shape.expert_gemm_flops() / median(name) / 1e12)
    add(name, "compile_s", p.compile_s)
    if best_bf16 and name != best_bf16:
      add(name, "compile_vs_bf16", p.compile_s / prepared[best_bf16].compile_s, baseline=best_bf16)
    if p.peak_gib is not None:
      add(name, "peak_gib", p.peak_gib)
      if best_bf16 and name != best_bf16 and prepared[best_bf16].peak_gib:
        add(name, "peak_vs_bf16", p.peak_gib / prepared[best_bf16].peak_gib, baseline=best_bf16)


def profile(prepared, names, directory, steps):
  """step.profile's trace summary of the balanced step of each of `names` ('/' in a name
  becomes '.' in its file names)."""
  as_step = {
    n.replace("/", "."): types.SimpleNamespace(executable=p.executable, call=p.calls["balanced"])
    for n, p in prepared.items()
  }
  step_benchmark.profile(as_step, [n.replace("/", ".") for n in names], directory, steps)


def selected_variants(args) -> list[str]:
  chosen = lambda text: [n.strip() for n in text.split(",") if n.strip()] if text else []
  only, skip = chosen(args.only), chosen(args.skip)
  unknown = sorted(set(only + skip) - set(ORDER))
  if unknown:
    raise SystemExit(f"unknown variants {unknown}; variants are {list(ORDER)}")
  names = [n for n in ORDER if (not only or n in only) and n not in skip]
  try:
    import qwix  # noqa: F401  (optional, benchmark-only)
  except ImportError as error:
    if PEER in names:
      print(f"{PEER} skipped: qwix not installed ({error})")
      names.remove(PEER)
  return names


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--shapes", default="fine,coarse", help=f"comma-separated, of {sorted(SHAPES)}"
  )
  parser.add_argument("--only", help=f"comma-separated variants to run, of {list(ORDER)}")
  parser.add_argument("--skip", help="comma-separated variants not to run")
  parser.add_argument("--reps", type=int, default=5, help="timed steps per turn, at least")
  parser.add_argument("--rounds", type=int, default=3, help="turns of every variant and routing")
  parser.add_argument("--warmup-s", type=float, default=0.2, help="untimed seconds before a turn")
  parser.add_argument("--warmup-steps", type=int, default=2, help="steps run after compiling")
  parser.add_argument("--deadline-s", type=float, help="skip variants that would end later")
  parser.add_argument("--profile", type=pathlib.Path, metavar="DIR")
  parser.add_argument("--profile-variants", default="bf16_padded,ragged/fp8_current")
  parser.add_argument("--profile-steps", type=int, default=3)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="tiny shape, few repetitions (no results file unless --out)",
  )
  parser.add_argument("--out", help="results file (default benchmarks/results/<gpu>/moe_step.json)")
  args = parser.parse_args(argv)
  if args.quick:
    args.shapes, args.reps, args.rounds, args.warmup_s, args.warmup_steps = "tiny", 1, 1, 0.0, 1
  args.shapes = [s.strip() for s in args.shapes.split(",")]
  unknown = [s for s in args.shapes if s not in SHAPES]
  if unknown:
    parser.error(f"unknown shapes {unknown}; shapes are {sorted(SHAPES)}")
  for flag in ("reps", "rounds", "warmup_steps"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
  return args


def main(argv=None):
  args = parse_args(argv)
  clock = Clock(args.deadline_s)
  device = jax.devices()[0]
  print(
    f"{device.device_kind}, jax {jax.__version__}; jaxquant kernels: "
    f"{kernels.available() or kernels.unavailable_reason()}",
    flush=True,
  )
  names = selected_variants(args)
  results = ResultFile(
    results_path(args.out, "moe_step", device.device_kind, smoke=args.quick),
    benchmark="moe_step",
    device=device.device_kind,
    jax_version=jax.__version__,
  )
  for index, shape_name in enumerate(args.shapes):
    print(f"shape {shape_name}: {SHAPES[shape_name]} at {clock.elapsed():.0f} s", flush=True)
    prepared = prepare_shape(shape_name, names, args, clock)
    if prepared:
      record_shape(results, shape_name, prepared, args)
    if args.profile and index == 0:
      try:  # the records are in; a failed profile should not cost the next shape
        profile(prepared, args.profile_variants.split(","), args.profile, args.profile_steps)
      except Exception as error:
        print(f"PROFILE FAILED: {type(error).__name__}: {error}", flush=True)
    del prepared
    gc.collect()
  print(
    f"done in {clock.elapsed():.0f} s" + (f"; merged into {results.path}" if results.path else "")
  )


if __name__ == "__main__":
  main()

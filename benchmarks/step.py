"""Train-step benchmark: a Llama-shaped decoder stack under every jaxquant preset and its peers.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/step.py \
        [--shapes 8b,1b] [--layers 2] [--batch 4 --seq 4096] [--only NAMES | --skip NAMES] \
        [--deadline-s S] [--profile DIR] [--remat MODE] [--quick] [--out FILE]

One full training step (forward, backward, AdamW) of `--layers` decoder layers built from
stock Flax layers (step_model.py: RMSNorm, grouped-query attention through
`jax.nn.dot_product_attention`, cuDNN's on the GPU, SwiGLU, `nn.Dense` without bias; no
embedding or logits head; params fp32, compute bf16) on random bf16 activations
[batch, seq, d_model], loss the mean square of the output. Variants (step_variants.py):
the stock model (`bf16`), every jaxquant preset swapped in with `quantize_model` (and
fp8_current / fp8_delayed with fast accumulation in every GEMM, `_fast`), Flax's
`Fp8DirectDotGeneralOp` and Qwix's FP8 quantized training per tensor and per channel
(skipped, with the reason printed, where qwix is not installed).

For each shape, in one process: every variant's step is traced, lowered and compiled once
(`compile_s`: tracing and lowering included, the time a user waits before the first step
runs; a tiny step runs before any, so that the backend's start-up counts in none), run for
a few warm-up steps that carry the model's collections (delayed-scaling state) forward,
then all variants are timed in interleaved turns (timing.py), each turn after a warm-up,
from the same parameters and optimizer state (no donation: every call writes new ones, as
a donating step would in place) and the collections its warm-up left.
Records per (variant, shape), merged into benchmarks/results/<gpu>/step.json (records.py):
`step_ms` (median over the rounds), `speedup_vs_bf16` and `speedup_vs_best_peer` (ratios
of median times, with `_lowest_round` records: the lowest ratio within one round; the best
peer is the fastest of the Flax and Qwix variants run), `compile_s`, `compile_vs_bf16`, and
`peak_gib`: XLA's memory analysis of the compiled step (its peak where XLA reports one,
else arguments + outputs + temporaries - aliased), a figure of that executable alone; the
allocator's process-wide peak (`memory_stats`), which cannot be reset between variants,
is only printed.
`activation_gib`: `peak_gib` less what the step holds besides activations, the bytes of
the params, their gradients (one per param, in its dtype) and the optimizer state, from
the step's own pytrees (`state_bytes`); `activation_vs_bf16` is that over bf16's, within
the run. A figure of XLA's peak, not of the residuals alone: the step donates nothing, so
XLA holds its outputs (new params and optimizer state) beside its arguments for the whole
call, and `activation_gib` is about XLA's temporaries at their peak (the residuals, the
gradients, the backward pass's work buffers) plus x plus one optimizer state's bytes, the
last two alike in every variant (benchmarks/residuals.py lists what the backward keeps).
`peak_donated_gib`, `activation_donated_gib` and `activation_donated_vs_bf16`: the same of
the step compiled as a training loop compiles it, the params and optimizer state donated
(`donate_argnums`), so that the new ones take the old ones' buffers. Compiled for its memory
only: the timed step donates nothing, so that every call starts from the same state. (On
the CPU XLA's reported peak leaves the temporaries out, of both executables: there the
figures are not a step's memory.)

Budget: variants compile in step_variants.ORDER (baseline, fp8_current and the peers
first, the slowest compiles last). With `--deadline-s`, a variant is skipped (and said so)
where its compiles (the timed step's and the donating one's), estimated from its compiles
at an earlier shape or else the longest so far, and the timing of the shape's variants
would end past the deadline.
Triton GEMM autotuning should be off on the GPU (XLA_FLAGS above; scripts/gpu.sh sets it):
it took minutes to compile quantized steps, and cuBLAS(Lt) takes those dots instead.

`--remat`: each decoder layer rematerialized (`nn.remat`) under a policy (REMAT_POLICIES):
`full` keeps nothing, `dots` JAX's dots without batch dims (the usual policy of a bf16
model; jaxquant's GEMMs, custom calls on the GPU, are not dots), `quantized`
`jaxquant.remat_policy()` (the quantized layers' codes, scales and the outputs a backward
reads; a model without jaxquant's layers keeps nothing under it). Its records are those
of the variant with `_remat_<mode>` appended.

`--profile DIR`: after timing the first shape, profiles a few steps of `--profile-variants`
(default bf16 and fp8_current) under `jax.profiler.trace` and writes DIR/profile.md and
DIR/profile.json (trace_summary.py: device time by category, host gaps, top kernels), plus
each variant's optimized HLO.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
import step_variants
import trace_summary
from records import ResultFile, results_path
from step_model import SHAPES, DecoderStack
from timing import Call, interleaved_seconds, speedup

import jaxquant
from jaxquant import kernels

# Init runs the forward pass once; params and the collections' shapes do not depend on
# the token count, so it runs on this many (a multiple of every scaling block).
INIT_TOKENS = 128

# --remat: the jax.checkpoint policy of each layer (None: no remat).
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "quantized": jaxquant.remat_policy(),
}


class Clock:
  """Seconds since the run started, and what is left of an optional deadline."""

  def __init__(self, deadline_s: float | None):
    self.start, self.deadline_s = time.perf_counter(), deadline_s

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def fits(self, seconds: float) -> bool:
    return self.deadline_s is None or self.elapsed() + seconds <= self.deadline_s


def loss_function(variant: step_variants.Variant):
  """(params, collections, x, key) -> (the step's loss, the collections the forward
  pass updated): what the train step differentiates."""

  def loss_fn(params, collections, x, key):
    y, updated = variant.model.apply(
      {"params": params, **collections}, x, rngs={"quant": key}, mutable=list(collections)
    )
    return jnp.mean(jnp.square(y.astype(jnp.float32))), updated

  return loss_fn


def train_step(variant: step_variants.Variant, tx: optax.GradientTransformation):
  """The README's Linen train step: grads w.r.t. the params and the other collections."""
  loss_fn = loss_function(variant)

  def step(params, opt_state, collections, x, key):
    (loss, updated), (grads, state_grads) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, collections, x, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (
      optax.apply_updates(params, updates),
      opt_state,
      variant.advance(updated, state_grads),
      loss,
    )

  return step


def init_variables(model, d_model: int):
  """All of a model's variables, from an INIT_TOKENS-token forward pass."""
  x = jnp.zeros((1, INIT_TOKENS, d_model), jnp.bfloat16)
  rngs = {"params": jax.random.key(0), "quant": jax.random.key(1)}
  return jax.jit(model.init)(rngs, x)


def variant_collections(variant, params, d_model: int) -> dict:
  """The variant's collections besides params (none for most), after checking that its
  param tree is the stock model's, so every variant trains the same parameters."""
  x = jax.ShapeDtypeStruct((1, INIT_TOKENS, d_model), jnp.bfloat16)
  rngs = {"params": jax.random.key(0), "quant": jax.random.key(1)}
  shapes = jax.eval_shape(variant.model.init, rngs, x)
  if jax.tree.structure(shapes["params"]) != jax.tree.structure(params):
    raise ValueError(f"{variant.name}: its param tree differs from the stock model's")
  if set(shapes) == {"params"}:
    return {}
  variables = dict(init_variables(variant.model, d_model))
  variables.pop("params")
  return variables


def state_bytes(params, opt_state) -> int:
  """Bytes of the step's training state: the params, their gradients (one per param, in
  its dtype) and the optimizer state (arrays or their shapes alike)."""
  size = lambda tree: sum(
    math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
  )
  return 2 * size(params) + size(opt_state)


def memory_gib(compiled) -> float | None:
  """The compiled step's device memory by XLA's analysis (None where it has none)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # a backend without the analysis
    return None
  if m is None:
    return None
  peak = getattr(m, "peak_memory_in_bytes", 0)
  if not peak:
    peak = (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      + m.temp_size_in_bytes
      - m.alias_size_in_bytes
    )
  return peak / 2**30


class Prepared:
  """One variant compiled and warmed up at one shape."""

  def __init__(self, variant, step, args, warmup_steps: int):
    self.name = variant.name
    start = time.perf_counter()
    lowered = jax.jit(step).lower(*args)
    lowered_s = time.perf_counter() - start
    self.executable = lowered.compile()
    self.compile_s = time.perf_counter() - start
    self.peak_gib = memory_gib(self.executable)
    params, opt_state, collections, x, key = args
    self.state_gib = state_bytes(params, opt_state) / 2**30
    self.activation_gib = None if self.peak_gib is None else self.peak_gib - self.state_gib
    # A second executable, compiled for its memory only: a training loop donates its state.
    start = time.perf_counter()
    donating = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    self.donated_compile_s = time.perf_counter() - start
    self.peak_donated_gib = memory_gib(donating)
    self.activation_donated_gib = (
      None if self.peak_donated_gib is None else self.peak_donated_gib - self.state_gib
    )
    start = time.perf_counter()
    loss = None
    for _ in range(warmup_steps):  # carries the collections (delayed scaling's state) on
      params, opt_state, collections, loss = self.executable(params, opt_state, collections, x, key)
    loss = float(loss)  # waits for the steps
    self.step_estimate_s = (time.perf_counter() - start) / max(warmup_steps, 1)
    self.call = Call(self.executable, (args[0], args[1], collections, x, key))
    peak = "" if self.peak_gib is None else f", XLA memory {self.peak_gib:.2f} GiB"
    if self.peak_donated_gib is not None:
      peak += f" ({self.peak_donated_gib:.2f} GiB donated)"
    print(
      f"  {self.name}: compiled in {self.compile_s:.1f} s (trace+lower {lowered_s:.1f} s){peak}; "
      f"warm-up {self.step_estimate_s * 1e3:.1f} ms/step, loss {loss:.4g}",
      flush=True,
    )
    if not math.isfinite(loss):
      raise FloatingPointError(f"{self.name}: loss {loss} after {warmup_steps} warm-up steps")


def timing_estimate_s(step_s: list[float], args) -> float:
  """Seconds interleaved_seconds takes for steps of these durations (timing.py's turns)."""
  per_turn = lambda s: 2 * s + max(args.warmup_s, s) + max(args.reps, int(args.warmup_s / s)) * s
  return sum(s + args.rounds * per_turn(s) for s in step_s)


def warm_backend(args):
  """Compiles and runs a tiny stock step first, so that the backend's one-time start-up
  (cuDNN, cuBLAS, the autotuner) is not counted in the first variant's compile_s."""
  shape = SHAPES["tiny"]
  stock = DecoderStack(shape, 1, attention=args.attention)
  params = init_variables(stock, shape.d_model)["params"]
  tx = optax.adamw(1e-4)
  x = jnp.zeros((1, INIT_TOKENS, shape.d_model), jnp.bfloat16)
  step = jax.jit(train_step(step_variants.build("bf16", stock), tx))
  jax.block_until_ready(step(params, tx.init(params), {}, x, jax.random.key(0)))


def prepare_shape(shape_name, names, args, clock, compile_history) -> dict[str, Prepared]:
  shape = SHAPES[shape_name]
  stock = DecoderStack(
    shape, args.layers, attention=args.attention, remat_policy=REMAT_POLICIES[args.remat]
  )
  params = init_variables(stock, shape.d_model)["params"]
  tx = optax.adamw(1e-4)
  opt_state = jax.jit(tx.init)(params)
  x = jax.random.normal(jax.random.key(2), (args.batch, args.seq, shape.d_model), jnp.bfloat16)
  key = jax.random.key(3)
  prepared = {}
  for name in names:
    seen = list(compile_history.values())
    guess = compile_history.get(name, max(seen) if seen else 0.0)
    steps = [p.step_estimate_s for p in prepared.values()]
    step_guess = max(steps) if steps else 0.0
    needed = (
      guess
      + args.warmup_steps * step_guess
      + timing_estimate_s(steps + [step_guess] if step_guess else steps, args)
    )
    if not clock.fits(needed):
      print(
        f"  {name}: skipped, the deadline: about {needed:.0f} s more needed, "
        f"{args.deadline_s - clock.elapsed():.0f} s left",
        flush=True,
      )
      continue
    print(f"  {name}: compiling (estimate {guess:.0f} s) at {clock.elapsed():.0f} s", flush=True)
    try:  # one variant that fails (to compile, or with a non-finite loss) costs only itself
      variant = step_variants.build(name, stock)
      collections = variant_collections(variant, params, shape.d_model)
      prepared[name] = Prepared(
        variant,
        train_step(variant, tx),
        (params, opt_state, collections, x, key),
        args.warmup_steps,
      )
    except Exception as error:
      print(
        f"  {name}: FAILED, not recorded: {type(error).__name__}: {str(error)[:2000]}", flush=True
      )
      continue
    # The deadline's estimate: both compilations.
    compile_history[name] = prepared[name].compile_s + prepared[name].donated_compile_s
  return prepared


def record_shape(results, shape_name, prepared, args, clock):
  steps = [p.step_estimate_s for p in prepared.values()]
  print(
    f"timing {len(prepared)} variants at {shape_name}, {args.rounds} rounds "
    f"(estimate {timing_estimate_s(steps, args):.0f} s) at {clock.elapsed():.0f} s",
    flush=True,
  )
  samples = interleaved_seconds(
    {n: p.call for n, p in prepared.items()},
    reps=args.reps,
    rounds=args.rounds,
    warmup_s=args.warmup_s,
  )
  peers = [n for n in samples if n in step_variants.PEERS]
  best_peer = min(peers, key=lambda n: statistics.median(samples[n]), default=None)
  if best_peer:
    print(f"best peer at {shape_name}: {best_peer}")

  remat = "" if args.remat == "none" else f"_remat_{args.remat}"

  def add(name, metric, value):
    print(f"step_{name + remat:<20} {shape_name:<5} {metric:<36} {value:9.3f}", flush=True)
    results.add(f"step_{name}{remat}", shape_name, metric, value)

  for name, times in samples.items():
    p = prepared[name]
    add(name, "step_ms", statistics.median(times) * 1e3)
    for base, metric in (("bf16", "speedup_vs_bf16"), (best_peer, "speedup_vs_best_peer")):
      if base and base != name and base in samples:
        value, lowest = speedup(samples[base], times)
        add(name, metric, value)
        add(name, f"{metric}_lowest_round", lowest)
    add(name, "compile_s", p.compile_s)
    if name != "bf16" and "bf16" in prepared:
      add(name, "compile_vs_bf16", p.compile_s / prepared["bf16"].compile_s)
    bf16 = prepared.get("bf16") if name != "bf16" else None
    for suffix in ("", "_donated"):
      peak = getattr(p, f"peak{suffix}_gib")
      if peak is None:
        continue
      activation = getattr(p, f"activation{suffix}_gib")
      add(name, f"peak{suffix}_gib", peak)
      add(name, f"activation{suffix}_gib", activation)
      baseline = None if bf16 is None else getattr(bf16, f"activation{suffix}_gib")
      if baseline is not None:
        add(name, f"activation{suffix}_vs_bf16", activation / baseline)


def profile(prepared, names, directory: pathlib.Path, steps: int):
  """A trace of `steps` steps of each variant, summarized into directory/profile.{md,json}."""
  directory.mkdir(parents=True, exist_ok=True)
  summaries = {}
  for name in names:
    if name not in prepared:
      print(f"profile: {name} was not compiled at this shape; skipped")
      continue
    p = prepared[name]
    hlo = p.executable.as_text()
    (directory / f"{name}.hlo.txt").write_text(hlo)
    jax.block_until_ready(p.call())
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        start = time.perf_counter()
        for _ in range(steps):
          out = p.call()
        jax.block_until_ready(out)
        wall_ms = (time.perf_counter() - start) / steps * 1e3
      events, source = trace_summary.load_events(pathlib.Path(trace_dir))
    summary = trace_summary.summarize(events, steps, trace_summary.custom_call_targets(hlo))
    summaries[name] = {"wall_ms": wall_ms, "trace_file": source, **summary}
    print(f"profile: {name}: {len(events)} device events from {source}")
  if summaries:
    (directory / "profile.json").write_text(json.dumps(summaries, indent=1) + "\n")
    table = trace_summary.markdown(summaries)
    (directory / "profile.md").write_text(table)
    print(table)


def selected_variants(args) -> list[str]:
  chosen = lambda text: [n.strip() for n in text.split(",") if n.strip()] if text else []
  only, skip = chosen(args.only), chosen(args.skip)
  unknown = sorted(set(only + skip) - set(step_variants.ORDER))
  if unknown:
    raise SystemExit(f"unknown variants {unknown}; variants are {list(step_variants.ORDER)}")
  names = [n for n in step_variants.ORDER if (not only or n in only) and n not in skip]
  reason = step_variants.qwix_unavailable_reason()
  if reason and any(n.startswith("qwix") for n in names):
    print(f"Qwix variants skipped: {reason}")
    names = [n for n in names if not n.startswith("qwix")]
  return names


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", default="8b,1b", help=f"comma-separated, of {sorted(SHAPES)}")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument(
    "--attention",
    choices=("cudnn", "xla"),
    help="dot_product_attention's implementation (default: cudnn on a GPU, else xla)",
  )
  parser.add_argument(
    "--only", help=f"comma-separated variants to run, of {list(step_variants.ORDER)}"
  )
  parser.add_argument("--skip", help="comma-separated variants not to run")
  parser.add_argument("--reps", type=int, help="timed steps per turn, at least (default 5)")
  parser.add_argument("--rounds", type=int, help="turns of every variant (default 5)")
  parser.add_argument(
    "--warmup-s", type=float, help="seconds of untimed steps before each turn (default 0.25)"
  )
  parser.add_argument("--warmup-steps", type=int, help="steps run after compiling (default 3)")
  parser.add_argument(
    "--deadline-s",
    type=float,
    help="skip variants whose compile and timing would end later than this",
  )
  parser.add_argument(
    "--profile",
    type=pathlib.Path,
    metavar="DIR",
    help="profile --profile-variants at the first shape into DIR",
  )
  parser.add_argument(
    "--remat",
    choices=tuple(REMAT_POLICIES),
    default="none",
    help="rematerialize each layer under this policy (see the module's docstring)",
  )
  parser.add_argument("--profile-variants", default="bf16,fp8_current")
  parser.add_argument("--profile-steps", type=int, default=3)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="tiny shape, 2 x 128 tokens, few repetitions (a smoke run: no results file unless --out)",
  )
  parser.add_argument(
    "--out", help="results file to merge into (default benchmarks/results/<gpu>/step.json)"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.shapes, args.batch, args.seq = "tiny", 2, 128
  for name, default, quick in (
    ("reps", 5, 2),
    ("rounds", 5, 2),
    ("warmup_s", 0.25, 0.0),
    ("warmup_steps", 3, 1),
  ):
    if getattr(args, name) is None:
      setattr(args, name, quick if args.quick else default)
  if args.warmup_steps < 1:
    parser.error(f"--warmup-steps {args.warmup_steps}: at least one step runs before timing")
  args.shapes = [s.strip() for s in args.shapes.split(",")]
  unknown = [s for s in args.shapes if s not in SHAPES]
  if unknown:
    parser.error(f"unknown shapes {unknown}; shapes are {sorted(SHAPES)}")
  if args.attention is None:
    args.attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  return args


def main(argv=None):
  args = parse_args(argv)
  clock = Clock(args.deadline_s)
  device = jax.devices()[0]
  print(
    f"{device.device_kind}, jax {jax.__version__}; jaxquant kernels: "
    f"{kernels.available() or kernels.unavailable_reason()}; attention {args.attention}; "
    f"{args.layers} layers, {args.batch} x {args.seq} tokens",
    flush=True,
  )
  names = selected_variants(args)
  results = ResultFile(
    results_path(args.out, "step", device.device_kind, smoke=args.quick),
    benchmark="step",
    device=device.device_kind,
    jax_version=jax.__version__,
  )
  warm_backend(args)
  compile_history: dict[str, float] = {}
  for index, shape_name in enumerate(args.shapes):
    print(f"shape {shape_name}: {SHAPES[shape_name]} at {clock.elapsed():.0f} s", flush=True)
    prepared = prepare_shape(shape_name, names, args, clock, compile_history)
    if prepared:
      record_shape(results, shape_name, prepared, args, clock)
    if args.profile and index == 0:
      try:  # the records are in; a failed profile should not cost the next shape
        profile(
          prepared,
          [n.strip() for n in args.profile_variants.split(",")],
          args.profile,
          args.profile_steps,
        )
      except Exception as error:
        print(f"PROFILE FAILED: {type(error).__name__}: {error}", flush=True)
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      print(f"process-wide device memory peak so far: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")
    del prepared
    gc.collect()
  print(
    f"done in {clock.elapsed():.0f} s; "
    + (f"merged into {results.path}" if results.path else "--quick: no results file written")
  )


if __name__ == "__main__":
  main()

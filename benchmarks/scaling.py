"""Scaling benchmark: the step benchmark's decoder stack trained on 1..N GPUs of one host.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/scaling.py \
        [--shape 8b] [--layers 2] [--devices 2,4,8] [--batch-per-device 4 --seq 4096] \
        [--layouts fsdp,fsdp_tp] [--variants NAMES] \
        [--profile-steps 2] [--top-kernels N] [--top-gaps N] [--hlo-dir DIR] [--quick]
        [--out FILE]

Weak scaling: on n devices the global batch is n x `--batch-per-device` sequences, so every
device does the work of the one-device step (step.py's model and train step: stock Flax
layers, AdamW, params fp32, compute bf16), and `scaling_efficiency` is the n-device
throughput over n times the one-device throughput of the same variant, both measured in
this run. The first n of `jax.devices()` are used, so every device count runs on the same
host and links.

Several processes (examples/launch_local.py, or `--coordinator --num-processes
--process-id` on each host; examples/lm/distributed.py): each takes part in every mesh, of
the first n / P devices of each of the P processes (n a multiple of P), and the one-device
baseline runs in each process on its first device. Every process must make the same calls,
so the turns' time-based warm-up is off (`--warmup-s 0`); process 0 prints and records.

Layouts (the mesh has two axes, `fsdp` and `tensor`):

- `fsdp`: fsdp=n. The batch splits n ways and every kernel along its d_model side (q/k/v/
  gate/up by rows, o/down by columns); XLA's SPMD partitioner all-gathers each kernel
  where its GEMMs need it and reduce-scatters its gradient.
- `fsdp_tp`: fsdp=n/2, tensor=2 (n even): Megatron tensor parallelism over pairs of devices
  as well (q/k/v/gate/up split by columns, o/down by rows, so the attention heads and the
  MLP's hidden units split), the batch over fsdp only. On 2 devices this is pure tensor
  parallelism.

Variants (`--variants`, default bf16, fp8_current, fp8_current_gather, fp8_delayed,
fp8_delayed_gather, flax_fp8, qwix_fp8_tensor): any of the step benchmark's
(step_variants.py: the stock model, jaxquant's presets swapped in with `quantize_model`,
each kernel quantized where XLA's partitioner places its cast, and the peers, Qwix's only
where it is installed), and `fp8_current_gather` / `fp8_delayed_gather`
(`weight_gather=ModelWeightGather(...)`: each device quantizes its shard and the FP8
codes are gathered, one usage once, sharding.md; only where fsdp > 1), and
`fp8_current_gather_shard`, fp8_current_gather whose input and output gradient are
scaled per FSDP shard (`shard_scaling=ops.ShardScaling(mesh, "fsdp")`: no amax
all-reduce before their casts, other bits than the one-device step's; fsdp layouts only).

Per (layout, n), the variants are compiled, warmed up and timed in interleaved turns
(timing.py). Records, merged into benchmarks/results/<gpu>x<devices>/scaling.json (the
machine's device count, e.g. h100x4), op
`scaling_<variant>`, shape `"<shape> <layout> n=<n>"` (`"<shape> one n=1"` for the one-device
baseline; ` p=<P>` added for a run of P processes): `step_ms`, `tokens_per_s`,
`speedup_vs_bf16` and, for jaxquant's variants,
`speedup_vs_best_peer` (the faster of Flax's and Qwix's, both at the same layout and n),
`scaling_efficiency`, and for n > 1 `all_gather_gib`: the bytes all-gathered per device and
step, the results of every all-gather in the compiled step's HLO (bf16 / fp32 / FP8 as XLA
placed them); and from a profile of `--profile-steps` steps (0: no profile), per step on
device 0: `all_gather_ms`, `reduce_scatter_ms` and `all_reduce_ms`, the device time of
each collective's kernels, `p2p_copy_ms`, that of the peer-to-peer copies beside them,
`compute_ms`, the busy time of all other kernels, and their own time by kind:
`compute_gemm_ms` (cuBLAS / cuBLASLt, jaxquant's and XLA's), `compute_cast_ms` (jaxquant's
casts and amaxes), `compute_attention_ms`, `compute_fusion_ms` (XLA's fusions),
`compute_copy_ms` and `compute_other_ms` (trace_summary.py's categories), and `idle_ms`,
the time between the profiled steps' first and last kernels in which device 0 runs no
kernel at all (a collective's wait is a kernel: this is the host's share, launch gaps and
synchronizations). With `--top-kernels N` each profile also prints its N busiest GEMM
kernels by name, time and launches a step, and with `--top-gaps N` its N longest idle
stretches with the kernels either side (neither recorded): which library kernel each GEMM
runs, and where the device waits for the host.
Collectives run on their own stream beside the compute, and a collective kernel's time
includes its wait for the other devices: a collective's time is its share of the
network's busy time, and the step time less `compute_ms` what the step loses to waiting.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import pathlib
import re
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
import step
import step_variants
import trace_summary
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from records import ResultFile, results_path
from step_model import SHAPES, DecoderStack
from timing import Call, interleaved_seconds, speedup

import jaxquant.flax as jqf
from jaxquant import kernels, ops, recipes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from lm import distributed  # noqa: E402  (examples/lm: the multi-process setup)

FSDP, TENSOR = "fsdp", "tensor"
LAYOUTS = ("fsdp", "fsdp_tp")
# The presets with the quantized gather (`weight_gather`), by the preset each extends.
GATHERED = {"fp8_current_gather": "fp8_current", "fp8_delayed_gather": "fp8_delayed"}
# Quantized gathers whose input and output gradient are scaled per FSDP shard
# (ops.ShardScaling: meshes whose other axes are of size 1, so fsdp layouts only).
SHARD_SCALED = {"fp8_current_gather_shard": "fp8_current"}
# The variants that differ from a one-device variant only when sharded: that variant.
SHARDED_ONLY = {**GATHERED, **SHARD_SCALED}
# Any of the step benchmark's variants (step_variants.ORDER), and the sharded-only ones.
KNOWN = step_variants.ORDER + tuple(SHARDED_ONLY)
VARIANTS = (
  "bf16",
  "fp8_current",
  "fp8_current_gather",
  "fp8_delayed",
  "fp8_delayed_gather",
  "flax_fp8",
  "qwix_fp8_tensor",
)

# Kernels [d_model, out] (their GEMM's K is d_model) and [in, d_model].
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Config:
  """One mesh: `n` devices as fsdp x tensor, driven by `processes` processes."""

  layout: str
  n: int
  processes: int = 1

  @property
  def tensor(self) -> int:
    return 2 if self.layout == "fsdp_tp" else 1

  @property
  def fsdp(self) -> int:
    return self.n // self.tensor

  def label(self, shape_name: str) -> str:
    """E.g. "8b fsdp n=4"; a run of several processes adds their count ("... p=4"), so
    its records sit beside the single process's."""
    label = f"{shape_name} {'one' if self.n == 1 else self.layout} n={self.n}"
    return label + (f" p={self.processes}" if self.processes > 1 else "")

  def devices(self) -> list:
    """The first n devices; with P processes the first n / P of each (every process takes
    part in every mesh), the one-device baseline each process's first."""
    processes = jax.process_count()
    if processes == 1:
      return jax.devices()[: self.n]
    if self.n == 1:
      return jax.local_devices()[:1]
    per_process = self.n // processes
    return [
      device
      for process in range(processes)
      for device in [d for d in jax.devices() if d.process_index == process][:per_process]
    ]

  def mesh(self) -> Mesh:
    devices = self.devices()
    return jax.make_mesh(
      (self.fsdp, self.tensor),
      (FSDP, TENSOR),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
      devices=devices,
    )


def configs(device_counts: list[int], layouts: list[str], processes: int = 1) -> list[Config]:
  """The one-device baseline, then each layout at every device count it can take (with
  several processes, a multiple of their count)."""
  chosen = [Config("fsdp", 1, processes)]
  for layout in layouts:
    for n in device_counts:
      config = Config(layout, n, processes)
      if n > 1 and n % config.tensor == 0 and n % processes == 0:
        chosen.append(config)
  return chosen


def param_spec(path: tuple[str, ...]) -> P:
  """The PartitionSpec of one param of the stack, by its module's name."""
  module, name = path[-2], path[-1]
  if name != "kernel":
    return P()  # the norms' scales: tiny, replicated
  if module.endswith(_COLUMN_PARALLEL):
    return P(FSDP, TENSOR)
  if module.endswith(_ROW_PARALLEL):
    return P(TENSOR, FSDP)
  raise ValueError(f"no sharding rule for the param {'/'.join(path)}")


def param_specs(params):
  return jax.tree_util.tree_map_with_path(
    lambda path, _: param_spec(tuple(k.key for k in path)), params
  )


def build_variant(name: str, stock: DecoderStack, mesh: Mesh, specs) -> step_variants.Variant:
  if name not in SHARDED_ONLY:
    return step_variants.build(name, stock)
  gather = jqf.ModelWeightGather(mesh, specs, axis=FSDP)
  shard_scaling = ops.ShardScaling(mesh, FSDP) if name in SHARD_SCALED else None
  recipe = recipes.resolve(SHARDED_ONLY[name])
  return step_variants.Variant(
    name,
    jqf.quantize_model(stock, recipe, weight_gather=gather, shard_scaling=shard_scaling),
    jqf.update_quant_state,
  )


_SHAPE = re.compile(
  r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|f8e8m0fnu|f4e2m1fn|"
  r"bf16|f16|f32|f64)\[([0-9,]*)\]"
)
_BITS = {
  "pred": 8,
  "s8": 8,
  "u8": 8,
  "f8e4m3fn": 8,
  "f8e5m2": 8,
  "f8e8m0fnu": 8,
  "f4e2m1fn": 4,
  "s16": 16,
  "u16": 16,
  "bf16": 16,
  "f16": 16,
  "s32": 32,
  "u32": 32,
  "f32": 32,
  "s64": 64,
  "u64": 64,
  "f64": 64,
}
_ALL_GATHER = re.compile(r"=\s*(.*?)\s+all-gather(-start)?\(")


def all_gather_bytes(hlo_text: str) -> int:
  """Bytes of the results of every all-gather in an HLO module's text. A synchronous
  all-gather's type lists its results; an `all-gather-start`'s lists its operands, then
  its results."""
  total = 0
  for line in hlo_text.splitlines():
    found = _ALL_GATHER.search(line)
    if not found:
      continue
    shapes = _SHAPE.findall(found.group(1))
    if found.group(2):
      shapes = shapes[len(shapes) // 2 :]
    for dtype, dims in shapes:
      elements = math.prod(int(d) for d in dims.split(",") if d)
      total += elements * _BITS[dtype] // 8
  return total


# NCCL's kernels (ncclDevKernel_AllGather_RING_LL, ...) by collective, and on the CPU the
# host events of XLA's collective ops; and the peer-to-peer copies (`MemcpyP2P`, over a
# hundred a step on four GPUs) that move data beside them, which are no compute either.
COLLECTIVES = {
  "all_gather": ("allgather", "all-gather"),
  "reduce_scatter": ("reducescatter", "reduce-scatter"),
  "all_reduce": ("allreduce", "all-reduce"),
  "p2p_copy": ("memcpyp2p", None),
}


def collective_of(event) -> str | None:
  name, op = event.name.lower().replace("_", ""), event.hlo_op.lower()
  for collective, (kernel, hlo_op) in COLLECTIVES.items():
    if kernel in name or (hlo_op is not None and op.startswith(hlo_op)):
      return collective
  return None


# The other kernels by kind (trace_summary's categories, library GEMMs all as one).
COMPUTE_PARTS = {
  "compute_gemm": ("jaxquant GEMM", "XLA GEMM (cuBLAS, cuBLASLt)"),
  "compute_cast": ("jaxquant cast, amax, dequantize",),
  "compute_attention": ("attention (cuDNN)",),
  "compute_fusion": ("XLA fusion",),
  "compute_copy": ("copy / transpose",),
  "compute_other": ("other",),
}


def compute_part_of(event) -> str:
  """The COMPUTE_PARTS kind of a kernel that is no collective."""
  kind = trace_summary.category(event, {})
  return next(part for part, kinds in COMPUTE_PARTS.items() if kind in kinds)


def profile_events(call: Call, steps: int) -> list:
  """Device 0's kernels in a profile of `steps` steps."""
  jax.block_until_ready(call())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        out = call()
      jax.block_until_ready(out)
    events, _ = trace_summary.load_events(pathlib.Path(trace_dir), device=0)
  return events


def profile_ms(events: list, steps: int) -> dict[str, float]:
  """Per step, from a profile's kernels: the device time of each collective's kernels,
  `compute` (the busy time of every other kernel, concurrent ones counted once), the
  other kernels' time by kind (COMPUTE_PARTS, each kernel's own time: where the compute
  grows when sharded), and `idle`, the profile's span in which no kernel runs."""
  times = {part: 0.0 for part in (*COLLECTIVES, *COMPUTE_PARTS)}
  compute = []
  for e in events:
    collective = collective_of(e)
    if collective:
      times[collective] += e.duration_ns
    else:
      compute.append(e)
      times[compute_part_of(e)] += e.duration_ns
  times["compute"] = trace_summary.busy_ns(compute)
  times["idle"] = trace_summary.idle_ns(events)
  return {name: ns / steps / 1e6 for name, ns in times.items()}


def busiest_gemm_kernels(events: list, steps: int, top: int) -> list[tuple[str, float, float]]:
  """The `top` GEMM kernels (compute_gemm) by device time: (name, ms a step, launches a
  step). Their names tell which library kernel each GEMM runs, and so which variant of a
  tile loses time beside the collectives (sharding.md, "Four H200, one process a GPU")."""
  gemms = [e for e in events if collective_of(e) is None and compute_part_of(e) == "compute_gemm"]
  if not gemms or not top:
    return []
  ranked = trace_summary.summarize(gemms, steps, top=top)["top_kernels"]
  return [(kernel["name"], kernel["ms"], kernel["count"]) for kernel in ranked]


def longest_idle_gaps(events: list, top: int) -> list[tuple[float, str, str]]:
  """The `top` longest stretches of a profile in which no kernel runs, longest first: (ms,
  the kernel whose end opens it, the kernel whose start closes it)."""
  gaps = sorted(trace_summary.idle_gaps(events), key=lambda gap: -gap[0])[:top]
  return [(ns / 1e6, before, after) for ns, before, after in gaps]


class Prepared:
  """One variant compiled and warmed up on one mesh."""

  def __init__(self, variant, config: Config, args, stock, params, shardings):
    mesh = config.mesh()
    replicated = NamedSharding(mesh, P())
    tx = optax.adamw(1e-4)
    placed = jax.device_put(params, shardings)
    opt_state = jax.jit(tx.init)(placed)
    collections = jax.device_put(
      step.variant_collections(variant, params, stock.shape.d_model), replicated
    )
    x = jax.device_put(
      jax.random.normal(
        jax.random.key(2),
        (args.batch_per_device * config.n, args.seq, stock.shape.d_model),
        jnp.bfloat16,
      ),
      NamedSharding(mesh, P(FSDP)),
    )
    key = jax.jit(lambda: jax.random.key(3), out_shardings=replicated)()  # any process's mesh
    train_step = jax.jit(
      step.train_step(variant, tx), out_shardings=(shardings, None, None, replicated)
    )
    self.executable = train_step.lower(placed, opt_state, collections, x, key).compile()
    hlo = self.executable.as_text()
    self.gather_gib = all_gather_bytes(hlo) / 2**30
    if args.hlo_dir and distributed.is_primary():
      args.hlo_dir.mkdir(parents=True, exist_ok=True)
      layout = config.layout if config.n > 1 else "one"
      (args.hlo_dir / f"{layout}_{config.n}gpu_{variant.name}.hlo.txt").write_text(hlo)
    state = (placed, opt_state, collections)
    loss = None
    for _ in range(args.warmup_steps):  # carries the collections on
      *state, loss = self.executable(*state, x, key)
    print(
      f"    {variant.name}: loss {float(loss):.4g}, all-gathered {self.gather_gib:.3f} GiB a step",
      flush=True,
    )
    if not math.isfinite(float(loss)):
      raise FloatingPointError(f"{variant.name}: loss {float(loss)} after the warm-up")
    self.call = Call(self.executable, (placed, opt_state, state[2], x, key))
    self.tokens = args.batch_per_device * config.n * args.seq


def run_config(config, names, args, stock, params, results, one_device_tps):
  label = config.label(args.shape)
  print(f"{label}: mesh fsdp={config.fsdp} x tensor={config.tensor}", flush=True)
  mesh = config.mesh()
  specs = param_specs(params)
  shardings = jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda s: isinstance(s, P)
  )
  prepared = {}
  for name in names:
    if name in SHARDED_ONLY and config.fsdp == 1:
      continue  # nothing is gathered or scaled per shard over fsdp
    if name in SHARD_SCALED and config.tensor > 1:
      continue  # per-shard scaling takes meshes whose other axes are of size 1
    try:  # one variant that fails costs only itself
      prepared[name] = Prepared(
        build_variant(name, stock, mesh, specs), config, args, stock, params, shardings
      )
    except Exception as error:
      print(
        f"    {name}: FAILED, not recorded: {type(error).__name__}: {str(error)[:2000]}", flush=True
      )
  if not prepared:
    return
  samples = interleaved_seconds(
    {n: p.call for n, p in prepared.items()},
    reps=args.reps,
    rounds=args.rounds,
    warmup_s=args.warmup_s,
  )

  peers = [n for n in samples if n in step_variants.PEERS]
  best_peer = min(peers, key=lambda n: statistics.median(samples[n]), default=None)

  def add(name, metric, value):
    print(f"scaling_{name:<20} {label:<18} {metric:<30} {value:10.4g}", flush=True)
    results.add(f"scaling_{name}", label, metric, value)

  for name, times in samples.items():
    p = prepared[name]
    tokens_per_s = p.tokens / statistics.median(times)
    add(name, "step_ms", statistics.median(times) * 1e3)
    add(name, "tokens_per_s", tokens_per_s)
    if name != "bf16" and "bf16" in samples:
      add(name, "speedup_vs_bf16", speedup(samples["bf16"], times)[0])
    if best_peer and name != best_peer and name not in step_variants.PEERS:
      add(name, "speedup_vs_best_peer", speedup(samples[best_peer], times)[0])
    if config.n == 1:
      one_device_tps[name] = tokens_per_s
    baseline = one_device_tps.get(SHARDED_ONLY.get(name, name))
    if config.n > 1 and baseline:
      add(name, "scaling_efficiency", tokens_per_s / (config.n * baseline))
    if config.n > 1:
      add(name, "all_gather_gib", p.gather_gib)
    if args.profile_steps:  # the one-device step too: what sharding adds to the compute
      try:
        events = profile_events(p.call, args.profile_steps)
        for part, ms in profile_ms(events, args.profile_steps).items():
          add(name, f"{part}_ms", ms)
        for kernel, ms, count in busiest_gemm_kernels(events, args.profile_steps, args.top_kernels):
          print(
            f"    {name} {label}: GEMM kernel {ms:.3f} ms, {count:g} launches: {kernel}",
            flush=True,
          )
        for ms, before, after in longest_idle_gaps(events, args.top_gaps):
          print(f"    {name} {label}: idle {ms:.3f} ms after {before} before {after}", flush=True)
      except Exception as error:  # the timings are in; a failed profile costs only itself
        print(f"    {name}: profile FAILED: {type(error).__name__}: {error}", flush=True)
  del prepared
  gc.collect()


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument(
    "--devices",
    default="2,4,8",
    help="comma-separated device counts beside the one-device baseline; "
    "counts above the devices present are skipped",
  )
  parser.add_argument("--batch-per-device", type=int, default=4)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--layouts", default=",".join(LAYOUTS))
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument(
    "--attention",
    choices=("cudnn", "xla"),
    help="dot_product_attention's implementation (default: cudnn on a GPU, else xla)",
  )
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--warmup-s", type=float, default=0.25)
  parser.add_argument("--warmup-steps", type=int, default=2)
  parser.add_argument("--profile-steps", type=int, default=2)
  parser.add_argument(
    "--top-kernels",
    type=int,
    default=0,
    help="print each profiled step's N busiest GEMM kernels, by name (not recorded)",
  )
  parser.add_argument(
    "--top-gaps",
    type=int,
    default=0,
    help="print each profile's N longest stretches with no kernel running (not recorded)",
  )
  parser.add_argument(
    "--hlo-dir", type=pathlib.Path, help="write each compiled step's optimized HLO here"
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="tiny shape, one layer, 1 x 128 tokens a device, few repetitions (a "
    "smoke run: no results file unless --out)",
  )
  parser.add_argument(
    "--out",
    help="results file to merge into (default benchmarks/results/<gpu>x<devices>/scaling.json)",
  )
  distributed.add_flags(parser)
  args = parser.parse_args(argv)
  distributed.initialize(args)  # before jax.default_backend() below starts the backends
  if args.quick:
    args.shape, args.layers, args.batch_per_device, args.seq = "tiny", 1, 1, 128
    args.reps, args.rounds, args.warmup_s, args.warmup_steps = 1, 1, 0.0, 1
  split = lambda text: [t.strip() for t in text.split(",") if t.strip()]
  args.layouts, args.variants = split(args.layouts), split(args.variants)
  for given, known, what in (
    (args.layouts, LAYOUTS, "layouts"),
    (args.variants, KNOWN, "variants"),
  ):
    unknown = sorted(set(given) - set(known))
    if unknown:
      parser.error(f"unknown {what} {unknown}; {what} are {list(known)}")
  try:
    args.devices = sorted({int(n) for n in split(args.devices)})
  except ValueError:
    parser.error(f"--devices {args.devices!r}: comma-separated integers")
  if args.warmup_steps < 1:
    parser.error(f"--warmup-steps {args.warmup_steps}: at least one step runs before timing")
  if args.top_kernels < 0:
    parser.error(f"--top-kernels {args.top_kernels}: a number of kernels, 0 (none) or more")
  if args.top_gaps < 0:
    parser.error(f"--top-gaps {args.top_gaps}: a number of gaps, 0 (none) or more")
  reason = step_variants.qwix_unavailable_reason()
  if reason and any(n.startswith("qwix") for n in args.variants):
    print(f"Qwix variants skipped: {reason}")
    args.variants = [n for n in args.variants if not n.startswith("qwix")]
  if args.attention is None:
    args.attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
  return args


def main(argv=None):
  args = parse_args(argv)
  with distributed.primary_output():
    run(args)


def run(args):
  if jax.process_count() > 1 and args.warmup_s:
    print(f"{jax.process_count()} processes: --warmup-s 0 (each must make the same calls)")
    args.warmup_s = 0.0
  devices = jax.devices()
  device = devices[0]
  counts = [n for n in args.devices if 1 < n <= len(devices)]
  skipped = [n for n in args.devices if n > len(devices)]
  print(
    f"{len(devices)} x {device.device_kind}, jax {jax.__version__}; jaxquant kernels: "
    f"{kernels.available() or kernels.unavailable_reason()}; {args.shape}, {args.layers} "
    f"layers, {args.batch_per_device} x {args.seq} tokens a device; device counts 1 and "
    f"{counts}" + (f" ({skipped} skipped: {len(devices)} devices)" if skipped else ""),
    flush=True,
  )
  # One file per machine size: benchmarks/results/<gpu>x<devices>/scaling.json.
  path = results_path(
    args.out, "scaling", device.device_kind, smoke=args.quick, devices=len(devices)
  )
  results = ResultFile(
    path if distributed.is_primary() else None,
    benchmark="scaling",
    device=device.device_kind,
    jax_version=jax.__version__,
  )
  stock = DecoderStack(SHAPES[args.shape], args.layers, attention=args.attention)
  params = jax.device_get(step.init_variables(stock, stock.shape.d_model)["params"])
  one_device_tps: dict[str, float] = {}
  for config in configs(counts, args.layouts, jax.process_count()):
    run_config(config, args.variants, args, stock, params, results, one_device_tps)
  print("done; " + (f"merged into {results.path}" if results.path else "--quick: no results file"))


if __name__ == "__main__":
  main()

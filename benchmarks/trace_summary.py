"""Where a profiled step's device time goes: kernels by category, from a jax.profiler trace.

    python benchmarks/trace_summary.py TRACE_DIR --steps N [--hlo optimized_hlo.txt]

Reads the newest `*.xplane.pb` under TRACE_DIR with `jax.profiler.ProfileData` (part of
jaxlib: no TensorBoard or xprof needed), or, where that fails, the `*.trace.json.gz` the
profiler writes beside it (the same events as plain JSON). Device events are the kernels,
copies and memsets on the GPU plane's stream lines (not the lines XLA derives from them,
which would count each kernel twice); a trace without a GPU plane (the CPU) falls back to
the host events XLA labels with an `hlo_op`, so the parser can be exercised there.

Each event gets one category, from its kernel name and, for a cuBLAS(Lt) GEMM, where the
event names its HLO op and the optimized HLO text is given, the op's custom-call target
(which attributes the cuBLASLt kernels that jaxquant's FFI GEMM launches to jaxquant;
`library_gemm_unattributed_ms` says how much GEMM time had no such op to go by):

- jaxquant GEMM / jaxquant cast, amax, dequantize: jaxquant's FFI calls;
- XLA GEMM (cuBLAS, cuBLASLt): XLA's own dots;
- attention (cuDNN);
- copy / transpose: copies, memcpys and transposes (fused or not);
- XLA fusion: every other XLA-generated kernel (elementwise, reductions);
- other: the rest (memsets, ...).

Per step: the device span (first kernel start to last kernel end over the profiled steps),
the busy time (the union of all events, so concurrent streams count once) and the idle
time between them: the host gaps, when the host has not queued the next kernel in time.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import pathlib
import re

import jax

# jaxlib 0.12.0.1's ProfileData.from_file aborts the process on a trace it should read (seen
# on the CPU), which no `except` can catch: there, only the JSON trace is read.
XPLANE_READABLE = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12)

CATEGORIES = (
  "jaxquant GEMM",
  "jaxquant cast, amax, dequantize",
  "XLA GEMM (cuBLAS, cuBLASLt)",
  "attention (cuDNN)",
  "copy / transpose",
  "XLA fusion",
  "other",
)


@dataclasses.dataclass(frozen=True)
class Event:
  name: str
  start_ns: float
  duration_ns: float
  hlo_op: str = ""


def custom_call_targets(hlo_text: str) -> dict[str, str]:
  """{instruction name: custom_call_target} of an HLO module's text."""
  pattern = re.compile(r'^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=.*\bcustom_call_target="([^"]+)"', re.M)
  return dict(pattern.findall(hlo_text))


_GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")


def is_library_gemm(event: Event) -> bool:
  """A cuBLAS / cuBLASLt / CUTLASS GEMM kernel that is not one of jaxquant's own."""
  name = event.name.lower()
  return "jaxquant" not in name and any(s in name for s in _GEMM_NAMES)


def category(event: Event, targets: dict[str, str]) -> str:
  """The event's category: by its kernel name; a library GEMM is jaxquant's where its HLO op
  is a jaxquant custom call (the op only splits GEMMs: inside a command buffer the op named
  may be the buffer's, so it never turns a fusion into a jaxquant kernel)."""
  name, op = event.name.lower(), event.hlo_op.lower()
  if "jaxquant" in name:
    return CATEGORIES[0] if "gemm" in name else CATEGORIES[1]
  if is_library_gemm(event):
    return CATEGORIES[0] if "jaxquant" in targets.get(event.hlo_op, "") else CATEGORIES[2]
  if any(s in name for s in ("cudnn", "fmha", "flash", "sdpa")):
    return CATEGORIES[3]
  if (
    "memcpy" in name
    or "transpose" in name
    or "transpose" in op
    or name.startswith("copy")
    or op.startswith("copy")
  ):
    return CATEGORIES[4]
  if "fusion" in name or "fusion" in op or name.startswith(("loop_", "input_", "wrapped_")):
    return CATEGORIES[5]
  return CATEGORIES[6]


# Lines a profiler derives from the stream lines (each kernel again, as an op or a module).
_DERIVED_LINES = (
  "XLA Modules",
  "XLA Ops",
  "Async XLA Ops",
  "Steps",
  "Framework Ops",
  "Framework Name Scope",
  "Source code",
  "XLA TraceMe",
  "TensorFlow Ops",
  "TensorFlow Name Scope",
)


def _device_lines(
  planes: list[tuple[str, list[tuple[str, list[Event]]]]], device: int | None = None
) -> list[Event]:
  """The events of the GPU planes' stream lines (of GPU `device` alone where given); on a
  trace with no GPU plane, the host events labelled with an HLO op."""
  plane = re.compile(r"/device:GPU" if device is None else rf"/device:GPU:{device}(?!\d)")
  gpu = [lines for name, lines in planes if plane.match(name)]
  if not gpu:
    return [e for _, lines in planes for _, events in lines for e in events if e.hlo_op]
  picked = []
  for lines in gpu:
    streams = [events for name, events in lines if name.startswith("Stream")]
    if not streams:
      streams = [events for name, events in lines if name not in _DERIVED_LINES]
    picked += [e for events in streams for e in events]
  return picked


def _stat(stats, key) -> str:
  value = dict(stats).get(key, "")
  return value if isinstance(value, str) else str(value)


def _planes_from_xplane(path: pathlib.Path):
  from jax.profiler import ProfileData

  data = ProfileData.from_file(str(path))
  return [
    (
      plane.name,
      [
        (
          line.name,
          [Event(e.name, e.start_ns, e.duration_ns, _stat(e.stats, "hlo_op")) for e in line.events],
        )
        for line in plane.lines
      ],
    )
    for plane in data.planes
  ]


def _planes_from_trace_json(path: pathlib.Path):
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  process, thread = {}, {}
  for e in trace["traceEvents"]:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[e["pid"], e["tid"]] = e["args"]["name"]
  lines = collections.defaultdict(list)
  for e in trace["traceEvents"]:
    if e.get("ph") == "X":
      lines[e["pid"], e.get("tid")].append(
        Event(e["name"], e["ts"] * 1e3, e.get("dur", 0) * 1e3, _stat(e.get("args", {}), "hlo_op"))
      )
  planes = collections.defaultdict(list)
  for (pid, tid), events in lines.items():
    planes[process.get(pid, str(pid))].append((thread.get((pid, tid), str(tid)), events))
  return list(planes.items())


def load_events(trace_dir: pathlib.Path, device: int | None = None) -> tuple[list[Event], str]:
  """(device events, which file they came from) of the newest trace under trace_dir: of
  every GPU, or of GPU `device` alone."""
  newest = lambda pattern: max(
    trace_dir.rglob(pattern), key=lambda p: p.stat().st_mtime, default=None
  )
  xplane, trace_json = newest("*.xplane.pb"), newest("*.trace.json.gz")
  errors = []
  for path, reader in ((xplane, _planes_from_xplane), (trace_json, _planes_from_trace_json)):
    if path is None or (reader is _planes_from_xplane and not XPLANE_READABLE):
      continue
    try:
      return _device_lines(reader(path), device), path.name
    except Exception as error:  # an older jaxlib's ProfileData, a truncated file
      errors.append(f"{path.name}: {type(error).__name__}: {error}")
  raise FileNotFoundError(f"no readable trace under {trace_dir}: {errors or 'no trace files'}")


def busy_ns(events: list[Event]) -> float:
  """Length of the union of the events' intervals."""
  total, end = 0.0, float("-inf")
  for e in sorted(events, key=lambda e: e.start_ns):
    start, stop = max(e.start_ns, end), e.start_ns + e.duration_ns
    if stop > start:
      total += stop - start
    end = max(end, stop)
  return total


def idle_gaps(events: list[Event]) -> list[tuple[float, str, str]]:
  """The stretches between the events' first start and last end in which no event runs, in
  time order: (ns, the event whose end opens it, the event whose start closes it). A gap
  opens when every event begun so far has ended, so overlapping streams leave none."""
  gaps, last = [], None
  for e in sorted(events, key=lambda e: e.start_ns):
    if last is not None and e.start_ns > last.start_ns + last.duration_ns:
      gaps.append((e.start_ns - last.start_ns - last.duration_ns, last.name, e.name))
    if last is None or e.start_ns + e.duration_ns > last.start_ns + last.duration_ns:
      last = e
  return gaps


def idle_ns(events: list[Event]) -> float:
  """The time between the events' first start and last end in which no event runs."""
  return sum(ns for ns, _, _ in idle_gaps(events))


def summarize(
  events: list[Event], steps: int, targets: dict[str, str] | None = None, top: int = 20
) -> dict:
  """Per-step milliseconds by category, the busy and idle device time, the top kernels."""
  targets = targets or {}
  events = [e for e in events if e.duration_ns > 0]
  if not events:
    raise ValueError("the trace holds no device events")
  per_step = lambda ns: ns / steps / 1e6
  span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
  busy = busy_ns(events)
  time, count = collections.Counter(), collections.Counter()
  kernel_time, kernel_count, kernel_category = collections.Counter(), collections.Counter(), {}
  target_time, unattributed = collections.Counter(), 0.0
  for e in events:
    c = category(e, targets)
    time[c] += e.duration_ns
    count[c] += 1
    kernel_time[e.name] += e.duration_ns
    kernel_count[e.name] += 1
    kernel_category[e.name] = c
    if e.hlo_op in targets:
      target_time[targets[e.hlo_op]] += e.duration_ns
    elif is_library_gemm(e):
      unattributed += e.duration_ns
  kernel_sum = sum(time.values())
  return {
    "steps": steps,
    "device_span_ms": per_step(span),
    "device_busy_ms": per_step(busy),
    "idle_ms": per_step(idle_ns(events)),
    # Above busy where streams overlap: the categories add up to this.
    "kernel_time_ms": per_step(kernel_sum),
    "categories": {
      c: {"ms": per_step(time[c]), "share": time[c] / kernel_sum, "kernels": count[c] / steps}
      for c in CATEGORIES
      if count[c]
    },
    "custom_call_targets_ms": {t: per_step(ns) for t, ns in target_time.most_common()},
    # Library GEMMs whose HLO op names no custom call: counted as XLA's, though some may be
    # jaxquant's (a trace without per-op annotations).
    "library_gemm_unattributed_ms": per_step(unattributed),
    "top_kernels": [
      {
        "name": name[:160],
        "category": kernel_category[name],
        "ms": per_step(ns),
        "count": kernel_count[name] / steps,
      }
      for name, ns in kernel_time.most_common(top)
    ],
  }


def markdown(summaries: dict[str, dict]) -> str:
  """One table, a column per profiled variant: ms per step (share of kernel time)."""
  names = list(summaries)
  rows = [f"| per step | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
  cell = lambda s, key: f"{s[key]:.2f}" if key in s else "-"
  for key, label in (
    ("wall_ms", "wall (host, timed)"),
    ("device_span_ms", "device span"),
    ("device_busy_ms", "device busy"),
    ("idle_ms", "idle (host gaps)"),
    ("library_gemm_unattributed_ms", "cuBLAS GEMMs of no known op"),
  ):
    rows.append(f"| {label} ms | {' | '.join(cell(summaries[n], key) for n in names)} |")
  for c in CATEGORIES:
    cells = []
    for n in names:
      entry = summaries[n]["categories"].get(c)
      cells.append(
        f"{entry['ms']:.2f} ({entry['share']:.0%}, {entry['kernels']:.0f} kernels)"
        if entry
        else "-"
      )
    rows.append(f"| {c} ms | {' | '.join(cells)} |")
  parts = ["\n".join(rows)]
  for n in names:
    top = summaries[n]["top_kernels"]
    lines = [
      f"\nTop kernels, {n} (ms per step, launches per step):",
      "",
      "| ms | count | category | kernel |",
      "|---|---|---|---|",
    ]
    lines += [
      f"| {k['ms']:.3f} | {k['count']:.0f} | {k['category']} | `{k['name'][:100]}` |" for k in top
    ]
    parts.append("\n".join(lines))
  return "\n".join(parts) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("trace_dir", type=pathlib.Path)
  parser.add_argument("--steps", type=int, required=True, help="steps the trace holds")
  parser.add_argument("--hlo", type=pathlib.Path, help="the step's optimized HLO text")
  args = parser.parse_args()
  targets = custom_call_targets(args.hlo.read_text()) if args.hlo else {}
  events, source = load_events(args.trace_dir)
  summary = summarize(events, args.steps, targets)
  print(f"from {source}")
  print(markdown({args.trace_dir.name: summary}))


if __name__ == "__main__":
  main()

"""The benchmarks' result files: `benchmarks/results/<gpu>/<benchmark>.json`, one per GPU
and benchmark, rewritten by the benchmark itself.

A file holds {"benchmark", "device", "records"}; a record is {"op", "shape", "metric",
"value"} plus where it came from: the command that measured it (with those settings of
RECORDED_ENVIRONMENT that were made), the date (UTC) and the JAX version. A run replaces
the records it measures (same op, shape and metric) and keeps the others, so a run of a
few sections (`--only`, as fits in one 10-minute device call) refreshes its part of the
file and every figure stays traceable to the run that produced it. The file is rewritten
after every record, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import shlex
import sys

RESULTS = pathlib.Path(__file__).parent / "results"


def gpu_name(device_kind: str) -> str:
  """The results folder of a device: its model, lower case ("NVIDIA H100 80GB HBM3" ->
  "h100", "NVIDIA H200" -> "h200"); the whole name, as a slug, where it has no model
  token of letters then digits."""
  model = re.search(r"\b[A-Za-z]+[0-9]+\b", device_kind)
  if model:
    return model.group(0).lower()
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def results_path(
  out: str | None, benchmark: str, device_kind: str, *, smoke: bool, devices: int = 1
):
  """Where a run merges its records: `out` if given, else the device's result file
  (`<gpu>/`, or `<gpu>x<devices>/` for a benchmark of several devices); a smoke run (small
  shapes or few repetitions) writes none unless `out` names one."""
  if out:
    return pathlib.Path(out)
  folder = gpu_name(device_kind) + (f"x{devices}" if devices > 1 else "")
  return None if smoke else RESULTS / folder / f"{benchmark}.json"


# Settings of the environment that change what a benchmark measures: XLA's flags, and JAX
# lowering threefry hashes (stochastic rounding's keys) to its own kernel, not inline code.
RECORDED_ENVIRONMENT = ("XLA_FLAGS", "JAX_THREEFRY_GPU_KERNEL_LOWERING")


def invocation(argv=None) -> str:
  """The command line that reproduces this run from the repository root."""
  argv = sys.argv if argv is None else argv
  script = pathlib.Path(argv[0])
  if script.parent.resolve() == RESULTS.parent.resolve():
    script = pathlib.Path("benchmarks") / script.name
  words = ["python3", str(script), *argv[1:]]
  settings = [(name, os.environ.get(name, "").strip()) for name in RECORDED_ENVIRONMENT]
  prefix = "".join(f"{name}={shlex.quote(value)} " for name, value in settings if value)
  return prefix + " ".join(shlex.quote(w) for w in words)


def _key(record) -> tuple:
  return record["op"], json.dumps(record["shape"]), record["metric"]


class ResultFile:
  """One benchmark's result file for one device, merged record by record; with no path
  (a smoke run) the records are only kept in memory."""

  def __init__(
    self,
    path: pathlib.Path | None,
    *,
    benchmark: str,
    device: str,
    jax_version: str,
    command: str | None = None,
  ):
    self.path = None if path is None else pathlib.Path(path)
    self.benchmark, self.device = benchmark, device
    self.provenance = {
      "command": command or invocation(),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
      "jax": jax_version,
    }
    self.records = []
    if self.path is not None and self.path.exists():
      old = json.loads(self.path.read_text())
      if old.get("benchmark") != benchmark or old.get("device") != device:
        raise ValueError(
          f"{self.path} holds benchmark {old.get('benchmark')!r} on {old.get('device')!r}, "
          f"this run is {benchmark!r} on {device!r}: records of one benchmark and device "
          "only merge with each other (pass another --out)"
        )
      self.records = old["records"]
    self._index = {_key(r): i for i, r in enumerate(self.records)}

  def add(self, op: str, shape, metric: str, value: float, **context) -> dict:
    """Records one figure (replacing the file's record of the same op, shape and metric)
    and rewrites the file; `context` (the baseline a ratio is against, say) is kept in the
    record beside it."""
    # Significant digits, not decimals: an error of 1e-4 keeps its digits as a speedup does.
    record = {
      "op": op,
      "shape": shape,
      "metric": metric,
      "value": float(f"{float(value):.5g}"),
      **context,
      **self.provenance,
    }
    key = _key(record)
    if key in self._index:
      self.records[self._index[key]] = record
    else:
      self._index[key] = len(self.records)
      self.records.append(record)
    if self.path is None:
      return record
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.path.write_text(
      json.dumps(
        {"benchmark": self.benchmark, "device": self.device, "records": self.records}, indent=1
      )
      + "\n"
    )
    return record

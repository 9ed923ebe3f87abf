"""benchmarks/records.py: one result file per (GPU, benchmark), merged record by record."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import records  # noqa: E402


@pytest.mark.parametrize(
  "kind, name",
  [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("cpu", "cpu"),
    ("Some GPU", "some_gpu"),
  ],
)
def test_gpu_name(kind, name):
  assert records.gpu_name(kind) == name


def test_results_path():
  assert (
    records.results_path(None, "gemm", "NVIDIA H200", smoke=False)
    == records.RESULTS / "h200" / "gemm.json"
  )
  assert records.results_path(None, "gemm", "NVIDIA H200", smoke=True) is None
  assert records.results_path("x.json", "gemm", "NVIDIA H200", smoke=True) == pathlib.Path("x.json")


def test_invocation_records_the_settings_that_change_a_measurement(monkeypatch):
  """The command a record keeps: the script from the repository root, its arguments, and
  XLA's flags and JAX's threefry lowering where they are set, quoted for a shell."""
  script = str(records.RESULTS.parent / "step.py")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("JAX_THREEFRY_GPU_KERNEL_LOWERING", raising=False)
  assert records.invocation([script, "--only", "a b"]) == "python3 benchmarks/step.py --only 'a b'"
  monkeypatch.setenv("XLA_FLAGS", "--x=1 --y=2")
  monkeypatch.setenv("JAX_THREEFRY_GPU_KERNEL_LOWERING", "1")
  assert records.invocation([script]) == (
    "XLA_FLAGS='--x=1 --y=2' JAX_THREEFRY_GPU_KERNEL_LOWERING=1 python3 benchmarks/step.py"
  )


def _file(path, command, **kw):
  return records.ResultFile(
    path,
    benchmark="gemm",
    device="NVIDIA H100 80GB HBM3",
    jax_version="0.11.2",
    command=command,
    **kw,
  )


def test_a_run_replaces_what_it_measured_and_keeps_the_rest(tmp_path):
  path = tmp_path / "h100" / "gemm.json"
  first = _file(path, "python3 benchmarks/gemm.py")
  first.add("gemm_fp8", "8192x8192x8192", "speedup_vs_bf16", 1.8)
  first.add("mlp_step", "tokens=16", "speedup_vs_bf16", 1.4)
  second = _file(path, "python3 benchmarks/gemm.py --only mlp")
  second.add("mlp_step", "tokens=16", "speedup_vs_bf16", 1.45)
  second.add("mlp_step", "tokens=16", "ms", 16.7)
  saved = json.loads(path.read_text())
  assert (saved["benchmark"], saved["device"]) == ("gemm", "NVIDIA H100 80GB HBM3")
  got = [(r["op"], r["metric"], r["value"], r["command"]) for r in saved["records"]]
  assert got == [
    ("gemm_fp8", "speedup_vs_bf16", 1.8, "python3 benchmarks/gemm.py"),
    ("mlp_step", "speedup_vs_bf16", 1.45, "python3 benchmarks/gemm.py --only mlp"),
    ("mlp_step", "ms", 16.7, "python3 benchmarks/gemm.py --only mlp"),
  ]
  assert all(r["jax"] == "0.11.2" and r["date"].endswith("Z") for r in saved["records"])


def test_shapes_given_as_lists_key_like_strings(tmp_path):
  path = tmp_path / "casts.json"
  for value in (0.8, 0.9):
    records.ResultFile(path, benchmark="casts", device="d", jax_version="j", command="c").add(
      "mxfp8_row_col", [16384, 8192], "fraction_of_copy", value
    )
  assert [r["value"] for r in json.loads(path.read_text())["records"]] == [0.9]


def test_values_keep_five_significant_digits(tmp_path):
  """A small error keeps its digits, a large figure its integer part."""
  saved = _file(None, "c")
  for op, value in (("error", 1.0449e-4 + 3e-10), ("tflops", 1322.2381), ("speedup", 1.09261)):
    saved.add(op, "s", "m", value)
  assert [r["value"] for r in saved.records] == [1.0449e-4, 1322.2, 1.0926]


def test_another_device_or_benchmark_is_refused(tmp_path):
  path = tmp_path / "gemm.json"
  _file(path, "c").add("op", "s", "m", 1.0)
  with pytest.raises(ValueError, match="'NVIDIA H200'.*another --out"):
    records.ResultFile(path, benchmark="gemm", device="NVIDIA H200", jax_version="j")
  with pytest.raises(ValueError, match="'casts'"):
    records.ResultFile(path, benchmark="casts", device="NVIDIA H100 80GB HBM3", jax_version="j")


def test_a_smoke_run_writes_nothing(tmp_path):
  smoke = records.ResultFile(None, benchmark="gemm", device="cpu", jax_version="j", command="c")
  smoke.add("op", "s", "m", 1.0)
  assert smoke.records[0]["value"] == 1.0 and not list(tmp_path.iterdir())


def test_the_committed_result_files_have_one_record_per_key_and_their_provenance():
  for path in records.RESULTS.glob("*/*.json"):
    saved = json.loads(path.read_text())
    # <gpu>/, or <gpu>x<devices>/ for a benchmark of several devices (scaling).
    gpu = records.gpu_name(saved["device"])
    assert path.stem == saved["benchmark"] and re.fullmatch(rf"{gpu}(x\d+)?", path.parent.name)
    keys = [(r["op"], json.dumps(r["shape"]), r["metric"]) for r in saved["records"]]
    assert len(keys) == len(set(keys)), path
    assert all(
      r["command"].startswith(("python3 benchmarks/", "XLA_FLAGS=")) and r["date"] and r["jax"]
      for r in saved["records"]
    ), path

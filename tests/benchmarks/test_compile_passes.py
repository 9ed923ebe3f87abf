"""benchmarks/compile_passes.py on log lines in XLA's format: pass times are summed per
variant for the train step's module only."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import compile_passes  # noqa: E402

_PREFIX = "I1125 21:17:37.096918   19882 "


def _pipeline(module):
  return (
    f"{_PREFIX}hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module {module}: optimization"
  )


def _pass(name, amount, unit):
  return (
    f"{_PREFIX}hlo_pass_pipeline.cc:206] HLO pass: {name} time: {amount} {unit} "
    f"({amount} {unit}) (cumulative: 1 s, max: 1 s, #called: 1)"
  )


LOG = [
  _pipeline("jit_step"),
  _pass("priority-fusion", 9, "s"),  # the tiny step: no variant yet
  "  fp8_delayed: compiling (estimate 2 s) at 13 s",
  _pipeline("jit_convert_element_type"),
  _pass("priority-fusion", 5, "s"),  # another module
  _pipeline("jit_step"),
  _pass("priority-fusion", 737, "ms"),
  _pass("algsimp", 69, "ms"),
  _pass("priority-fusion", 3, "ms"),
  _pass("cse", 500, "us"),
  f"{_PREFIX}gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit_step time: 1.3 s "
  "(1299994 us) (cumulative: 10.6 s, max: 3.12 s, #called: 21)",
  f"{_PREFIX}gpu_compiler.cc:3017] GpuCompiler::RunBackend for jit_step time: 1.59 s "
  "(1586138 us) (cumulative: 6.22 s, max: 1.59 s, #called: 21)",
  "  fp8_delayed: compiled in 3.9 s (trace+lower 0.8 s), XLA memory 4.69 GiB",
  _pipeline("jit_step"),
  _pass("priority-fusion", 7, "s"),  # its warm-up's helpers
  "  nvfp4: compiling (estimate 4 s) at 22 s",
  _pipeline("jit_step"),
  _pass("priority-fusion", 1.86, "s"),
  "  nvfp4: compiled in 6.0 s (trace+lower 0.3 s), XLA memory 5.42 GiB",
]


def test_pass_times_are_summed_per_variant_for_the_step_module():
  delayed, nvfp4 = compile_passes.per_variant(LOG)
  assert delayed["variant"] == "fp8_delayed" and delayed["compile_s"] == 3.9
  assert abs(delayed["passes"]["priority-fusion"] - 0.740) < 1e-9
  assert abs(delayed["passes"]["cse"] - 0.0005) < 1e-12
  assert delayed["phases"] == {"RunHloPasses": 1.3, "RunBackend": 1.59}
  assert nvfp4["passes"] == {"priority-fusion": 1.86} and nvfp4["phases"] == {}
  table = compile_passes.table([delayed, nvfp4], top=1)
  assert "| fp8_delayed | 3.9 | 1.30 | 1.59 | 0.81 | priority-fusion 0.74 |" in table
  assert "| nvfp4 | 6.0 | - | - | 1.86 | priority-fusion 1.86 |" in table

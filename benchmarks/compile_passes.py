"""Where a step's XLA compile time goes: HLO pass times per variant, from step.py's log.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1 \\
        XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 benchmarks/step.py --shapes 1b \\
        --only bf16,fp8_current,fp8_delayed,nvfp4,hybrid > step.log 2>&1
    python3 benchmarks/compile_passes.py step.log [--top 4]

With those logging settings XLA prints each HLO pass's time (`HLO pass: NAME time: ...`)
and the totals of GpuCompiler::RunHloPasses and ::RunBackend (LLVM and PTX) of each module.
Lines of the train step's module (`jit_step`) are summed per variant, between step.py's
`<variant>: compiling` and `<variant>: compiled in ...`; the tiny step it compiles first,
the warm-up steps and the other modules (small jitted helpers) are left out.
"""

from __future__ import annotations

import argparse
import collections
import re

STEP_MODULE = "jit_step"
_PIPELINE = re.compile(r"Running HLO pass pipeline on module (\S+):")
_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) ")
_PHASE = re.compile(r"GpuCompiler::(RunHloPasses|RunBackend) for (\S+) time: ([\d.]+) (us|ms|s) ")
_COMPILING = re.compile(r"^\s+(\S+): compiling")
_COMPILED = re.compile(r"^\s+(\S+): compiled in ([\d.]+) s")
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def per_variant(lines) -> list[dict]:
  """[{variant, compile_s, phases: {RunHloPasses, RunBackend}, passes: Counter}] in log order."""
  variants = []
  module = compiling = None
  passes, phases = collections.Counter(), {}
  for line in lines:
    if match := _COMPILING.match(line):
      compiling = match.group(1)
      passes, phases = collections.Counter(), {}
    elif match := _PIPELINE.search(line):
      module = match.group(1)
    elif compiling is None:
      continue
    elif (match := _PASS.search(line)) and module == STEP_MODULE:
      passes[match.group(1)] += float(match.group(2)) * _SECONDS[match.group(3)]
    elif (match := _PHASE.search(line)) and match.group(2) == STEP_MODULE:
      phases[match.group(1)] = float(match.group(3)) * _SECONDS[match.group(4)]
    elif (match := _COMPILED.match(line)) and match.group(1) == compiling:
      variants.append(
        {
          "variant": compiling,
          "compile_s": float(match.group(2)),
          "phases": phases,
          "passes": passes,
        }
      )
      compiling = None
  return variants


def table(variants: list[dict], top: int) -> str:
  rows = [
    "| variant | compile (s) | RunHloPasses (s) | RunBackend (s) | passes summed (s) | "
    "slowest passes (s) |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for v in variants:
    slowest = ", ".join(f"{name} {t:.2f}" for name, t in v["passes"].most_common(top))
    hlo_passes, backend = (
      f"{v['phases'][name]:.2f}" if name in v["phases"] else "-"
      for name in ("RunHloPasses", "RunBackend")
    )
    rows.append(
      f"| {v['variant']} | {v['compile_s']:.1f} | {hlo_passes} | "
      f"{backend} | {sum(v['passes'].values()):.2f} | {slowest} |"
    )
  return "\n".join(rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("log", help="step.py's output with XLA's pass logging (above)")
  parser.add_argument("--top", type=int, default=4, help="slowest passes listed per variant")
  args = parser.parse_args(argv)
  with open(args.log, errors="replace") as log:
    print(table(per_variant(log), args.top))


if __name__ == "__main__":
  main()

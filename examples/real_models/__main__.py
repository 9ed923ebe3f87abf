"""jaxquant's swap-in on the models of real packages: gemma, MaxText, EasyDeL, transformers.

Where a package is installed, this builds tiny randomly initialised models with the
package's own model classes and config classes (no weights are downloaded) and, per
model:

1. prints the swap report (`jaxquant.flax.swap_report`) under each trained recipe: how
   many weight GEMMs run quantized, how many stay in high precision and why, and how
   many contractions have no param operand;
2. checks that the bf16 recipe gives the plain model's logits, bit for bit;
3. trains a few optimizer steps on one fixed batch under fp8_current, fp8_delayed, mxfp8
   and nvfp4 and under the plain model, and checks that the losses are finite and fall
   (or end near the plain run's); under fp8_delayed, that every delayed-scaling state
   (`jaxquant.flax.RoleState`) records amaxes and moves its scales over the steps.

Models: gemma (Gemma 3 dense; Gemma 4 dense, with per-layer inputs, and MoE), MaxText
(llama2 through `quantize_model`, and through MaxText's own `quant=` protocol with
`jaxquant.flax.MaxTextQuantization`), EasyDeL (Llama with gradient checkpointing),
transformers' Flax models (Llama; GPT-2 with its head tied and untied). A
package that is not installed is reported as skipped, with the pip command that installs
it. A step that fails is recorded with its error's first line; the run goes on.

  python examples/real_models --packages gemma,maxtext   # Python 3.12, JAX 0.12
  python examples/real_models --packages easydel         # Python 3.11, JAX 0.10
  python examples/real_models --packages transformers    # transformers 4.57.6 with Flax
  python examples/real_models --packages gemma --only MoE --traceback

The packages need different JAX versions, so each runs in its own environment:
examples/README.md ("Real packages") gives the install commands. Not part of CI.
Each package's models live in `<package>_models.py`, the checks in `checks.py`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import pathlib
import platform
import sys
from typing import Any, Optional

import jax
from checks import (
  BATCH,
  LEARNING_RATE,
  SEQ,
  STEPS,
  TRAINED_RECIPES,
  VOCAB,
  first_line,
  run_linen,
  run_nnx,
)

# What a skipped package says: the lean installs are in examples/README.md, "Real packages".
PIP = {
  "gemma": "pip install gemma==4.0.1 (Python 3.12, JAX 0.12; examples/README.md, Real packages)",
  "maxtext": "pip install --no-deps maxtext==0.2.5 (JAX 0.12; examples/README.md, Real packages)",
  "easydel": "pip install easydel==0.3.0 (Python 3.11, JAX 0.10; examples/README.md)",
  "transformers": "pip install transformers==4.57.6 flax (examples/README.md, Real packages)",
}


# name -> (its distribution, the module of its models, how its models are checked). The
# module is imported only where the package is installed.
PACKAGES = {
  "gemma": ("gemma", "gemma_models", run_linen),
  "maxtext": ("maxtext", "maxtext_models", run_nnx),
  "easydel": ("easydel", "easydel_models", run_nnx),
  "transformers": ("transformers", "transformers_models", run_linen),
}


def version(distribution: str) -> Optional[str]:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def run_package(name: str, only: str, show_traceback: bool) -> dict:
  distribution, module, run = PACKAGES[name]
  if version(distribution) is None:
    print(f"{name}: not installed, skipped ({PIP[name]})")
    return {"package": name, "skipped": f"not installed: {PIP[name]}"}
  result: dict[str, Any] = {"package": name, "version": version(distribution), "models": []}
  try:
    models = importlib.import_module(module).models()
  except Exception as error:  # noqa: BLE001 (a package that cannot build is a finding too)
    result["failures"] = [{"step": "build", "error": first_line(error)}]
    print(f"{name}: FAILED to build: {first_line(error)}")
    return result
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 1, VOCAB)
  for model in [m for m in models if only in m.name]:
    print(f"{name}: {model.name}")
    try:
      result["models"].append(run(name, model, tokens, show_traceback))
    except Exception as error:  # noqa: BLE001 (recorded; the next model still runs)
      failure = {"step": "build or plain run", "error": first_line(error)}
      result["models"].append({"package": name, "model": model.name, "failures": [failure]})
      print(f"  FAILED {failure['step']}: {failure['error']}")
  return result


def report_cells(summary: Optional[dict]) -> list[str]:
  if not summary:
    return ["-", "-", "-"]
  reasons = summary["high_precision"]
  high = f"{sum(reasons.values())}" + "".join(
    f"; {reason.removeprefix('high precision: ')}: {n}" for reason, n in reasons.items()
  )
  return [str(summary["quantized"]), high, str(summary["not_a_weight_gemm"])]


def model_rows(model: dict) -> list[list[str]]:
  same = {True: "yes", False: "NO", None: "failed"}[model.get("bf16_bit_identical")]
  rows = [["bf16", "-", "-", "-", f"logits bit-identical to plain: {same}", "-", "-"]]
  for recipe in ("plain", *TRAINED_RECIPES):
    run = model.get("train", {}).get(recipe)
    losses = " ".join(f"{x:.3f}" for x in run["losses"]) if run else "failed"
    gap = f"{run['last_loss_gap_to_plain']:+.1%}" if run and recipe != "plain" else "-"
    summary = model.get("swap_report", {}).get(recipe)
    verdict = run["verdict"] if run else "-"
    if run and "delayed_scaling" in run:
      scales = run["delayed_scaling"]
      verdict += (
        f"; {scales['verdict']} ({scales['scales_off_initial_at_end']} of {scales['scales']}"
        f" scales in {scales['states']} states moved; changed per step:"
        f" {' '.join(map(str, scales['scales_changed_per_step']))})"
      )
      if scales["not_advanced"]:
        verdict += f"; not advanced: {', '.join(scales['not_advanced'])}"
    rows.append([recipe, *report_cells(summary), losses, gap, verdict])
  rows += [[f"FAILED {f['step']}", f["error"], "", "", "", "", ""] for f in model["failures"]]
  return rows


def table(results: list[dict]) -> str:
  """A Markdown table: per model, the bf16 check and each recipe's report and losses."""
  header = ["package", "model", "recipe", "weight GEMMs quantized", "high precision (why)"]
  header += ["not a weight GEMM", "losses", "last loss vs plain", "verdict"]
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for package in results:
    name = package["package"]
    if "skipped" in package:
      lines.append(f"| {name} | - | skipped: {package['skipped']} |" + " |" * 6)
    for failure in package.get("failures", []):
      lines.append(f"| {name} | - | FAILED {failure['step']} | {failure['error']} |" + " |" * 5)
    for model in package.get("models", []):
      for row in model_rows(model):
        lines.append("| " + " | ".join([name, model["model"], *row]) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--packages", default="gemma,maxtext,easydel,transformers", help="comma-separated"
  )
  parser.add_argument("--out", default=None, help="JSON of the findings (and the table as .md)")
  parser.add_argument("--only", default="", help="run only the models whose name holds this")
  parser.add_argument("--traceback", action="store_true", help="print each failure's traceback")
  args = parser.parse_args(argv)
  names = [n for n in args.packages.split(",") if n]
  results = [run_package(name, args.only, args.traceback) for name in names]
  print(table(results))
  out = pathlib.Path(
    args.out or f"examples/results/real_models/{jax.default_backend()}_{'_'.join(names)}.json"
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  environment = {
    "command": " ".join(["python", *sys.argv]),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "flax": version("flax"),
    "optax": version("optax"),
    "backend": jax.default_backend(),
    "steps": STEPS,
    "learning_rate": LEARNING_RATE,
  }
  out.write_text(json.dumps({"environment": environment, "packages": results}, indent=1) + "\n")
  out.with_suffix(".md").write_text(table(results) + "\n")
  print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
  main()

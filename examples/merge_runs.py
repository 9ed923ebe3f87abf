"""Merge train_lm.py runs of one configuration into one report.

Each run trained some recipes from some seeds (say one seed a GPU, or bf16 in one device
call and a recipe in the next); the merged output folder holds the val_loss.png,
results.md and curves.json that one run of them all would have written, gaps taken per
seed to bf16 of the same seed. Runs of different configurations (model, training, corpus,
GPU kind, JAX version) and a recipe's seed trained twice are refused (lm/merge.py).

  python examples/merge_runs.py --out merged run_seed0 run_seed1 run_seed2
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

from lm import merge, report

# suggested_nvfp4's analysis, written beside the results of the run that trained it.
SENSITIVITY_FILES = ("sensitivity.md", "sensitivity.png")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "runs",
    nargs="+",
    type=pathlib.Path,
    help="output folders of train_lm.py (each with its curves.json)",
  )
  parser.add_argument("--out", type=pathlib.Path, required=True, help="the merged output folder")
  args = parser.parse_args(argv)
  runs = []
  for folder in args.runs:
    path = folder / report.CURVES_JSON
    if not path.is_file():
      raise SystemExit(f"{folder}: no {report.CURVES_JSON} (not a train_lm.py output folder)")
    runs.append(merge.Run(str(folder), *report.read_curves_json(path)))
  try:
    info, results = merge.merge(runs)
  except ValueError as error:
    raise SystemExit(f"merge_runs.py: {error}") from None
  report.write_outputs(args.out, results, info)
  for name in SENSITIVITY_FILES:  # the policy is one (checked), so any run's analysis is it
    source = next((folder / name for folder in args.runs if (folder / name).is_file()), None)
    if source is not None:
      shutil.copyfile(source, args.out / name)
  print(report.results_table(results, info["not_run"], info["unigram_entropy_nats"]), end="")
  print(f"{len(runs)} runs merged into {args.out}")


if __name__ == "__main__":
  main()

"""Runs of one configuration trained apart, reported as one.

A study of several recipes from several seeds need not run in one process: each seed, or
each recipe, can train in its own (one per GPU, or one per device call), and the runs'
curves.json files merge into the results one run would have written. A recipe's gap is
still taken per seed, to bf16 of the same seed, wherever that bf16 trained: on a GPU two
runs of one seed differ as much as two seeds do (docs/example.md), so a bf16 trained in the
same process buys no tighter pairing.

Runs merge only if they trained the same thing: every field of their run info but those
in PER_RUN must be equal (the model, the training configuration, the corpus, the GPU kind,
the JAX version, ...), and no recipe may have trained the same seed in two of them (unless
as different repeats: train_seeds.py --repeats). Where bf16 is among the runs, a recipe's
run whose seed has no completed bf16 run is left out (its gap cannot be taken), and the
merged notes say which.
"""

from __future__ import annotations

import dataclasses

from lm import report
from lm.recipes import PLAIN_RECIPE, SUGGESTED_RECIPE

# Run-info fields that say which part of the study a run did, not what it trained. "seed"
# is the first seed; "validation_seed" draws the validation batches when they are sampled
# (eval_batches not None), so then it must be equal after all. "device" is the device's
# index (the same kind of device is checked by "device_kind"). "suggested_policy" must
# agree among the runs that trained suggested_nvfp4 (each chooses it from its own first
# seed). "command" is each run's own command line (the merged info keeps the first's).
PER_RUN = (
  "seed",
  "seeds",
  "validation_seed",
  "not_run",
  "notes",
  "noise_floor_scale",
  "device",
  "suggested_policy",
  "merged_runs",
  "repeat",
  "noise_band_runs",
  "unpaired",
  "command",
)


def _validation_seed(info: dict) -> int:
  return info.get("validation_seed", info["seed"])  # runs before it was recorded: --seed


@dataclasses.dataclass(frozen=True)
class Run:
  name: str  # where it came from, for error messages
  info: dict
  results: list[report.RecipeResult]


def _check_same_configuration(first: Run, other: Run) -> None:
  for field in sorted((first.info.keys() | other.info.keys()) - set(PER_RUN)):
    if first.info.get(field) != other.info.get(field):
      raise ValueError(
        f"{other.name}: run info {field!r} is {other.info.get(field)!r}, but "
        f"{first.info.get(field)!r} in {first.name}: only runs of one configuration merge"
      )
  ours, theirs = _validation_seed(first.info), _validation_seed(other.info)
  if first.info["train"]["eval_batches"] is not None and ours != theirs:
    raise ValueError(
      f"{other.name}: validation seed {theirs}, but {ours} in {first.name}: with sampled "
      f"validation batches (eval_batches={first.info['train']['eval_batches']}) that seed "
      "draws them, so runs merge only with the same one (train_lm.py --validation-seed)"
    )


def _suggested_policy(runs: list[Run]) -> list[str] | None:
  trained = [r for r in runs if any(x.recipe == SUGGESTED_RECIPE for x in r.results)]
  unrecorded = [r.name for r in trained if "suggested_policy" not in r.info]
  if len(trained) > 1 and unrecorded:
    raise ValueError(
      f"{', '.join(unrecorded)}: trained {SUGGESTED_RECIPE} without recording "
      "which modules it kept in bf16, so it cannot be checked to be the policy of "
      "the other runs that trained it"
    )
  policies = {r.name: r.info["suggested_policy"] for r in trained if "suggested_policy" in r.info}
  if len({tuple(p) for p in policies.values()}) > 1:
    raise ValueError(
      f"{SUGGESTED_RECIPE} kept different modules in bf16 in different runs "
      f"({policies}): they trained different policies under one name"
    )
  return next(iter(policies.values()), None)


def _paired(results: list[report.RecipeResult]) -> tuple[list[report.RecipeResult], list[str]]:
  """The results whose gap can be taken (all of them without any bf16 run), and the runs
  left out for want of a completed bf16 run of their seed, named."""
  if not any(r.recipe == PLAIN_RECIPE for r in results):
    return results, []
  paired = {r.seed for r in results if r.recipe == PLAIN_RECIPE and r.completed and not r.repeat}
  keep = lambda r: r.recipe in (PLAIN_RECIPE, report.NOISE_BAND) or r.seed in paired
  left_out = [
    f"{r.recipe} seed {r.seed}" + (f" (repeat {r.repeat})" if r.repeat else "")
    for r in results
    if not keep(r)
  ]
  return [r for r in results if keep(r)], left_out


def merge(runs: list[Run]) -> tuple[dict, list[report.RecipeResult]]:
  """The run info and the results of runs merged: every recipe's seeds together, bf16 first
  and the other recipes in the order they first appear, seeds in ascending order."""
  if not runs:
    raise ValueError("nothing to merge: no runs given")
  first = runs[0]
  for other in runs[1:]:
    _check_same_configuration(first, other)
  trained_in: dict[tuple[str, int, int], str] = {}
  for run in runs:
    for result in run.results:
      key = (result.recipe, result.seed, result.repeat)
      if key in trained_in:
        again = f" (repeat {result.repeat})" if result.repeat else ""
        raise ValueError(
          f"{result.recipe} seed {result.seed}{again} trained in both {trained_in[key]} "
          f"and {run.name}: merge keeps one run of each recipe and seed"
        )
      trained_in[key] = run.name
  order = list(dict.fromkeys(r.recipe for run in runs for r in run.results))
  order.sort(key=lambda recipe: recipe != PLAIN_RECIPE)  # bf16 first, the rest as they came
  results, unpaired = _paired([r for run in runs for r in run.results])
  results.sort(key=lambda r: (order.index(r.recipe), r.seed, r.repeat))
  not_run = list(
    dict.fromkeys(name for run in runs for name in run.info["not_run"] if name not in order)
  )
  seeds = sorted({seed for run in runs for seed in run.info["seeds"]})
  info = {
    **first.info,
    "seed": min(run.info["seed"] for run in runs),
    "seeds": seeds,
    "validation_seed": _validation_seed(first.info),
    "not_run": not_run,
    "merged_runs": len(runs),
    "notes": "".join(dict.fromkeys(run.info.get("notes", "") for run in runs))
    + (
      f"Left out, as bf16 of their seed did not complete: {', '.join(unpaired)}.\n"
      if unpaired
      else ""
    ),
    "unpaired": unpaired,
    "noise_floor_scale": next(
      (
        run.info["noise_floor_scale"]
        for run in runs
        if run.info.get("noise_floor_scale") is not None
      ),
      None,
    ),
  }
  policy = _suggested_policy(runs)
  info.pop("suggested_policy", None)
  if policy is not None:
    info["suggested_policy"] = policy
  return info, results

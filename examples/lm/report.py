"""The run's outputs: validation-loss curves (PNG), a markdown table, and a JSON of it all,
over every recipe and seed (lm/stats.py: mean, spread and the paired interval of the gaps)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
from typing import Optional

import numpy as np

from lm import stats
from lm.recipes import CUSTOM_RECIPE, PLAIN_RECIPE, SUGGESTED_RECIPE

CURVES_JSON = "curves.json"
CURVES_PNG = "val_loss.png"
RESULTS_TABLE = "results.md"
# train_lm.py --noise-floor: bf16 trained again from slightly perturbed parameters. Its gap
# to bf16 is the spread of one run's final loss that has nothing to do with number formats
# (chaotic training dynamics, and on GPUs non-deterministic reductions), so it says how far
# apart two single runs may end by chance.
NOISE_FLOOR = "bf16_perturbed"
# The policy the sensitivity analysis suggests, against the rule it is to beat, seed by seed.
POLICY_COMPARISON = (SUGGESTED_RECIPE, CUSTOM_RECIPE)


@dataclasses.dataclass
class RecipeResult:
  """One training run: one recipe from one seed."""

  recipe: str
  planned_steps: int
  eval_steps: list[int]  # steps after which validation ran (0: before training)
  val_losses: list[float]  # nats, mean over the fixed validation batches
  train_losses: list[float]  # nats, one per step
  # Mean step time of each window between host syncs (the first, compiling step excluded).
  window_step_seconds: list[float]
  compile_seconds: float  # the first step, compilation included (the recipe's first seed)
  wall_seconds: float = 0.0  # the whole run: compiles, steps and evaluations
  seed: int = 0

  @property
  def final_val_loss(self) -> float:
    return self.val_losses[-1]

  @property
  def completed(self) -> bool:
    return self.eval_steps[-1] == self.planned_steps

  @property
  def median_step_seconds(self) -> float:
    return statistics.median(self.window_step_seconds)


def relative_gap(loss: float, baseline: Optional[float]) -> Optional[float]:
  return None if baseline is None else (loss - baseline) / baseline


@dataclasses.dataclass(frozen=True)
class RecipeSummary:
  """A recipe over its seeds: the runs, and the statistics of those that completed."""

  recipe: str
  runs: tuple[RecipeResult, ...]
  loss: Optional[stats.Summary]  # final validation loss over the completed seeds
  # Per-seed relative gap to bf16 of the same seed (both completed): mean, sd, paired
  # t-interval.
  gap: Optional[stats.Summary]

  @property
  def completed_seeds(self) -> list[int]:
    return [r.seed for r in self.runs if r.completed]


def _final_losses(results: list[RecipeResult], recipe: str) -> dict[int, float]:
  """recipe's final validation loss by seed, of the runs that completed."""
  return {r.seed: r.final_val_loss for r in results if r.recipe == recipe and r.completed}


def paired_gap(results: list[RecipeResult], recipe: str, baseline: str) -> Optional[stats.Summary]:
  """recipe's relative gap to baseline, taken per seed (both completed) and summarized:
  mean, sd and the paired t-interval; None without a common seed."""
  losses, reference = _final_losses(results, recipe), _final_losses(results, baseline)
  gaps = [relative_gap(loss, reference[seed]) for seed, loss in losses.items() if seed in reference]
  return stats.summarize(gaps) if gaps else None


def summarize(results: list[RecipeResult]) -> list[RecipeSummary]:
  """One summary per recipe, in the order the recipes first ran."""
  by_recipe: dict[str, list[RecipeResult]] = {}
  for r in results:
    by_recipe.setdefault(r.recipe, []).append(r)
  summaries = []
  for recipe, runs in by_recipe.items():
    done = [r.final_val_loss for r in runs if r.completed]
    summaries.append(
      RecipeSummary(
        recipe,
        tuple(runs),
        stats.summarize(done) if done else None,
        paired_gap(results, recipe, PLAIN_RECIPE),
      )
    )
  return summaries


def _summary_json(summary: Optional[stats.Summary]) -> Optional[dict]:
  return None if summary is None else dataclasses.asdict(summary)


def write_curves_json(path: pathlib.Path, results: list[RecipeResult], run_info: dict) -> None:
  """{"run": run_info, "recipes": {recipe: {"final_val_loss": summary, "gap_to_bf16":
  summary, "seeds": {seed: run}}}}, plus "suggested_nvfp4_vs_custom": summary when both
  ran; a summary is {n, mean, std, interval}."""
  payload = {"run": run_info, "recipes": {}}
  recipe, baseline = POLICY_COMPARISON
  comparison = paired_gap(results, recipe, baseline)
  if comparison is not None:
    payload[f"{recipe}_vs_{baseline}"] = _summary_json(comparison)
  for summary in summarize(results):
    payload["recipes"][summary.recipe] = {
      "final_val_loss": _summary_json(summary.loss),
      "gap_to_bf16": _summary_json(summary.gap),
      "seeds": {
        str(r.seed): {
          **dataclasses.asdict(r),
          "final_val_loss": r.final_val_loss,
          "completed": r.completed,
          "median_step_seconds": r.median_step_seconds,
        }
        for r in summary.runs
      },
    }
  path.write_text(json.dumps(payload, indent=1))


def read_curves_json(path: pathlib.Path) -> tuple[dict, list[RecipeResult]]:
  """write_curves_json's inverse: the run info and every run, in the order written."""
  payload = json.loads(path.read_text())
  fields = {f.name for f in dataclasses.fields(RecipeResult)}
  results = [
    RecipeResult(**{k: v for k, v in run.items() if k in fields})
    for recipe in payload["recipes"].values()
    for run in recipe["seeds"].values()
  ]
  return payload["run"], results


def title(preset: str, n_params: int) -> str:
  return f"byte LM on the Python stdlib, preset {preset} ({n_params / 1e6:.1f}M parameters)"


def write_outputs(out: pathlib.Path, results: list[RecipeResult], info: dict) -> None:
  """val_loss.png, results.md and curves.json of a run; info is run_info with the recipes
  not run ("not_run") and the text results.md ends with ("notes")."""
  out.mkdir(parents=True, exist_ok=True)
  heading = title(info["preset"], info["parameters"])
  entropy = info["unigram_entropy_nats"]
  write_curves_json(out / CURVES_JSON, results, info)
  plot_validation_curves(out / CURVES_PNG, results, entropy, heading)
  write_results_table(
    out / RESULTS_TABLE, results, info["not_run"], entropy, heading, info["notes"]
  )


def _common_curve(runs: list[RecipeResult]) -> tuple[list[int], np.ndarray]:
  """The eval steps every run reached, and [runs, steps] of their losses there."""
  steps = sorted(set.intersection(*(set(r.eval_steps) for r in runs)))
  return steps, np.array(
    [[dict(zip(r.eval_steps, r.val_losses, strict=False))[s] for s in steps] for r in runs]
  )


def _band(axis, steps, values: np.ndarray, style: dict):
  """The mean over runs as a line, min to max over runs as a band."""
  (line,) = axis.plot(steps, values.mean(axis=0), **style)
  if len(values) > 1:
    axis.fill_between(
      steps, values.min(axis=0), values.max(axis=0), color=line.get_color(), alpha=0.2, linewidth=0
    )
  return line


def plot_validation_curves(
  path: pathlib.Path, results: list[RecipeResult], unigram_entropy: float, title: str
) -> None:
  """Two panels: every recipe's validation loss, and below it its gap to bf16 in %.

  With several seeds a line is the mean over seeds and the band spans the lowest to the
  highest seed; the gap is taken per seed (to bf16 of the same seed), then averaged.
  The gaps (a percent or two) are invisible at the loss panel's scale, which spans the
  whole descent from the unigram entropy.
  """
  import matplotlib

  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt

  figure, (losses, gaps) = plt.subplots(
    2, 1, figsize=(8, 8), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
  )
  summaries = summarize(results)
  baseline = {
    r.seed: dict(zip(r.eval_steps, r.val_losses, strict=False))
    for r in results
    if r.recipe == PLAIN_RECIPE
  }
  n_seeds = max(len(s.runs) for s in summaries)
  for summary in summaries:
    runs = list(summary.runs)
    style = {
      "marker": "o",
      "markersize": 3,
      "label": summary.recipe,
      "linestyle": "--" if summary.recipe == NOISE_FLOOR else "-",
    }
    steps, values = _common_curve(runs)
    line = _band(losses, steps, values, style)
    # Gaps at the steps both runs evaluated, from the first eval after step 0 (at step 0 the
    # runs differ only by the untrained model's forward pass).
    paired = [r for r in runs if r.seed in baseline]
    if paired:
      steps = [
        s for s in _common_curve(paired)[0] if s and all(s in baseline[r.seed] for r in paired)
      ]
      if steps:
        curve = lambda r: dict(zip(r.eval_steps, r.val_losses, strict=False))
        relative = np.array(
          [[100 * (curve(r)[s] / baseline[r.seed][s] - 1) for s in steps] for r in paired]
        )
        _band(gaps, steps, relative, {**style, "color": line.get_color(), "label": None})
  losses.axhline(
    unigram_entropy,
    color="gray",
    linestyle="--",
    linewidth=1,
    label=f"unigram byte entropy ({unigram_entropy:.2f})",
  )
  # The first eval (an untrained model, ~ln 256) would squash the curves: show from just
  # above the unigram entropy down.
  lowest = min(min(r.val_losses) for r in results)
  losses.set_ylim(lowest - 0.05 * (unigram_entropy - lowest), unigram_entropy * 1.1)
  losses.set_ylabel("validation loss (nats per byte)")
  losses.set_title(
    title + (f"\nmean of {n_seeds} seeds; bands: lowest to highest seed" if n_seeds > 1 else "")
  )
  losses.grid(alpha=0.3)
  losses.legend()
  gaps.axhline(0, color="black", linewidth=0.8)
  gaps.set_xlabel("step")
  gaps.set_ylabel(f"gap to {PLAIN_RECIPE} (%)")
  gaps.grid(alpha=0.3)
  figure.tight_layout()
  figure.savefig(path)
  plt.close(figure)


def _loss_text(summary: RecipeSummary) -> str:
  if summary.loss is None:
    return "n/a"
  if summary.loss.std is None:
    return f"{summary.loss.mean:.4f}"
  return f"{summary.loss.mean:.4f} ± {summary.loss.std:.4f}"


def _gap_text(gap: Optional[stats.Summary]) -> str:
  if gap is None:
    return "n/a"
  if gap.interval is None:
    return f"{gap.mean:+.2%}"
  return f"{gap.mean:+.2%} [{gap.interval[0]:+.2%}, {gap.interval[1]:+.2%}]"


def results_table(results: list[RecipeResult], not_run: list[str], unigram_entropy: float) -> str:
  """Gaps are relative to bf16's final loss of the same seed, between runs that completed."""
  summaries = summarize(results)
  seeds = sorted({r.seed for r in results})
  several = len(seeds) > 1
  lines = [
    "| recipe | seeds completed | final val loss (nats)"
    + (", mean ± sd" if several else "")
    + " | spread (sd / mean) | gap to bf16"
    + (", mean [95% CI]" if several else "")
    + " | median step (ms) | first step, compile incl. (s) | recipe wall time (s) |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for summary in summaries:
    runs = summary.runs
    loss_text = _loss_text(summary)
    stopped = [r for r in runs if not r.completed]
    if stopped:
      loss_text += "".join(
        f" (seed {r.seed} stopped at step {r.eval_steps[-1]} of {r.planned_steps}: time budget)"
        for r in stopped
      )
    spread = (
      f"{summary.loss.std / summary.loss.mean:.2%}"
      if summary.loss is not None and summary.loss.std is not None
      else "n/a"
    )
    step_ms = 1e3 * statistics.median(s for r in runs for s in r.window_step_seconds)
    lines.append(
      f"| {summary.recipe} | {len(summary.completed_seeds)} of {len(runs)} | "
      f"{loss_text} | {spread} | {_gap_text(summary.gap)} | {step_ms:.1f} | "
      f"{runs[0].compile_seconds:.1f} | {sum(r.wall_seconds for r in runs):.0f} |"
    )
  lines.extend(f"| {name} | not run | n/a | n/a | n/a | n/a | n/a | n/a |" for name in not_run)
  lines.append("")
  if several:
    lines.append(
      f"Seeds {', '.join(map(str, seeds))}: each sets the initial parameters and the "
      "data order, the same for every recipe. A recipe's gap is taken per seed, to "
      "bf16 of the same seed, then averaged; its 95% interval is the paired "
      "t-interval of those per-seed gaps (mean ± t(0.975, n-1) sd / sqrt(n)). "
      "Spread: the sample standard deviation of the final loss over seeds, "
      "relative to its mean."
    )
    lines.append("")
    lines += [
      "| recipe | " + " | ".join(f"seed {s}" for s in seeds) + " |",
      "| --- | " + " | ".join("---" for _ in seeds) + " |",
    ]
    baseline = {
      r.seed: r.final_val_loss for r in results if r.recipe == PLAIN_RECIPE and r.completed
    }
    for summary in summaries:
      by_seed = {r.seed: r for r in summary.runs}
      cells = []
      for seed in seeds:
        run = by_seed.get(seed)
        if run is None or not run.completed:
          cells.append("n/a")
          continue
        gap = relative_gap(run.final_val_loss, baseline.get(seed))
        cells.append(
          f"{run.final_val_loss:.4f}"
          + ("" if gap is None or summary.recipe == PLAIN_RECIPE else f" ({gap:+.2%})")
        )
      lines.append(f"| {summary.recipe} | " + " | ".join(cells) + " |")
    lines.append("")
  recipe, baseline = POLICY_COMPARISON
  comparison = paired_gap(results, recipe, baseline)
  if comparison is not None:
    lines.append(
      f"{recipe} against {baseline} (the same number of modules in bf16, chosen by "
      f"the sensitivity analysis instead of by layer), per seed then averaged: "
      f"{_gap_text(comparison)}" + (" (95% paired t-interval)." if comparison.interval else ".")
    )
    lines.append("")
  if any(r.recipe == NOISE_FLOOR for r in results):
    lines.append(
      f"{NOISE_FLOOR}: bf16 again, from slightly perturbed initial parameters "
      "(train_lm.py --noise-floor). Its gap is the noise floor of single-run gaps: "
      "how far a run ends from bf16 with no quantization at all."
    )
    lines.append("")
  lines.append(f"Unigram byte entropy of the validation split: {unigram_entropy:.4f} nats.")
  return "\n".join(lines) + "\n"


def write_results_table(
  path: pathlib.Path,
  results: list[RecipeResult],
  not_run: list[str],
  unigram_entropy: float,
  heading: str,
  extra: str = "",
) -> None:
  path.write_text(
    f"# {heading}\n\n"
    + results_table(results, not_run, unigram_entropy)
    + (f"\n{extra}" if extra else "")
  )

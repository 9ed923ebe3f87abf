"""The run's outputs: validation-loss curves (PNG), a markdown table, and a JSON of it all."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
from typing import Optional

from lm.recipes import PLAIN_RECIPE

CURVES_JSON = "curves.json"
CURVES_PNG = "val_loss.png"
RESULTS_TABLE = "results.md"
# train_lm.py --noise-floor: bf16 trained again from slightly perturbed parameters. Its gap
# to bf16 is the spread of one run's final loss that has nothing to do with number formats
# (chaotic training dynamics, and on GPUs non-deterministic reductions), so it says how far
# apart two single runs may end by chance.
NOISE_FLOOR = "bf16_perturbed"


@dataclasses.dataclass
class RecipeResult:
  recipe: str
  planned_steps: int
  eval_steps: list[int]  # steps after which validation ran (0: before training)
  val_losses: list[float]  # nats, mean over the fixed validation batches
  train_losses: list[float]  # nats, one per step
  # Mean step time of each window between host syncs (the first, compiling step excluded).
  window_step_seconds: list[float]
  compile_seconds: float  # the first step, compilation included
  wall_seconds: float = 0.0  # the whole recipe: compiles, steps and evaluations

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


def _baseline_loss(results: list[RecipeResult]) -> Optional[float]:
  return next((r.final_val_loss for r in results if r.recipe == PLAIN_RECIPE and r.completed),
              None)


def write_curves_json(path: pathlib.Path, results: list[RecipeResult], run_info: dict) -> None:
  payload = {"run": run_info,
             "recipes": {r.recipe: {**dataclasses.asdict(r), "final_val_loss": r.final_val_loss,
                                    "completed": r.completed,
                                    "median_step_seconds": r.median_step_seconds}
                         for r in results}}
  path.write_text(json.dumps(payload, indent=1))


def plot_validation_curves(path: pathlib.Path, results: list[RecipeResult],
                           unigram_entropy: float, title: str) -> None:
  """Two panels: every run's validation loss, and below it each run's gap to bf16 in %.

  The gaps (a percent or two) are invisible at the loss panel's scale, which spans the
  whole descent from the unigram entropy.
  """
  import matplotlib
  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt

  figure, (losses, gaps) = plt.subplots(2, 1, figsize=(8, 8), dpi=120, sharex=True,
                                        gridspec_kw={"height_ratios": [3, 2]})
  baseline = next((r for r in results if r.recipe == PLAIN_RECIPE), None)
  baseline_at = dict(zip(baseline.eval_steps, baseline.val_losses)) if baseline else {}
  for result in results:
    style = {"marker": "o", "markersize": 3, "label": result.recipe,
             "linestyle": "--" if result.recipe == NOISE_FLOOR else "-"}
    line, = losses.plot(result.eval_steps, result.val_losses, **style)
    # Gaps at the steps both runs evaluated, from the first eval after step 0 (at step 0 the
    # runs differ only by the untrained model's forward pass).
    shared = [(s, l) for s, l in zip(result.eval_steps, result.val_losses) if s in baseline_at and s]
    if shared:
      gaps.plot([s for s, _ in shared], [100 * (l / baseline_at[s] - 1) for s, l in shared],
                **{**style, "color": line.get_color(), "label": None})
  losses.axhline(unigram_entropy, color="gray", linestyle="--", linewidth=1,
                 label=f"unigram byte entropy ({unigram_entropy:.2f})")
  # The first eval (an untrained model, ~ln 256) would squash the curves: show from just
  # above the unigram entropy down.
  lowest = min(min(r.val_losses) for r in results)
  losses.set_ylim(lowest - 0.05 * (unigram_entropy - lowest), unigram_entropy * 1.1)
  losses.set_ylabel("validation loss (nats per byte)")
  losses.set_title(title)
  losses.grid(alpha=0.3)
  losses.legend()
  gaps.axhline(0, color="black", linewidth=0.8)
  gaps.set_xlabel("step")
  gaps.set_ylabel(f"gap to {PLAIN_RECIPE} (%)")
  gaps.grid(alpha=0.3)
  figure.tight_layout()
  figure.savefig(path)
  plt.close(figure)


def results_table(results: list[RecipeResult], not_run: list[str], unigram_entropy: float) -> str:
  """Gaps are relative to bf16's final loss, and only between runs that completed."""
  baseline = _baseline_loss(results)
  lines = ["| recipe | final val loss (nats) | gap to bf16 | median step (ms) "
           "| first step, compile incl. (s) | recipe wall time (s) |",
           "| --- | --- | --- | --- | --- | --- |"]
  for r in results:
    gap = relative_gap(r.final_val_loss, baseline) if r.completed else None
    gap_text = "n/a" if gap is None else f"{gap:+.2%}"
    loss_text = f"{r.final_val_loss:.4f}"
    if not r.completed:
      loss_text += f" (stopped at step {r.eval_steps[-1]} of {r.planned_steps}: time budget)"
    lines.append(f"| {r.recipe} | {loss_text} | {gap_text} | "
                 f"{1e3 * r.median_step_seconds:.1f} | {r.compile_seconds:.1f} | "
                 f"{r.wall_seconds:.0f} |")
  lines.extend(f"| {name} | not run | n/a | n/a | n/a | n/a |" for name in not_run)
  lines.append("")
  if any(r.recipe == NOISE_FLOOR for r in results):
    lines.append(f"{NOISE_FLOOR}: bf16 again, from slightly perturbed initial parameters "
                 "(train_lm.py --noise-floor). Its gap is the noise floor of single-run gaps: "
                 "how far a run ends from bf16 with no quantization at all.")
    lines.append("")
  lines.append(f"Unigram byte entropy of the validation split: {unigram_entropy:.4f} nats.")
  return "\n".join(lines) + "\n"


def write_results_table(path: pathlib.Path, results: list[RecipeResult], not_run: list[str],
                        unigram_entropy: float, heading: str) -> None:
  path.write_text(f"# {heading}\n\n" + results_table(results, not_run, unigram_entropy))

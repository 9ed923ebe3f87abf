"""The run's outputs: validation-loss curves (PNG), a markdown table, and a JSON of it all,
over every recipe and seed (lm/stats.py: mean, spread and the paired interval of the gaps).

Two statistics of a run are compared between recipes: its final validation loss, and the
mean of its validation losses at the tail evaluations (`TrainConfig.tail_evals`, the last
ones, where the learning rate has decayed). Runs of one seed repeated (`repeat` > 0,
train_seeds.py --repeats) measure how far the same seed ends apart from run to run; they
stay out of the statistics over seeds and are summarized apart (`run_to_run`). The noise
band (NOISE_BAND: bf16 from other seeds, gaps taken to bf16 of the run's first seed) says
how large a single-seed gap must be to mean something."""

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
# train_lm.py --noise-band N: bf16 from N further seeds. A run's gap to bf16 of its own seed
# can be read against these runs' gaps to bf16 of the first seed: with no quantization at
# all, a change of seed (parameters and data order) moves the loss that far.
NOISE_BAND = "bf16_other_seed"
# The half-width a gap's 95% interval is to reach; results give the seeds that would take.
TARGET_HALF_WIDTH = 0.005
FINAL, TAIL = "final", "tail"  # the statistics of a run that gaps are taken on
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
  # The tail evaluations' steps (TrainConfig.tail_evals); empty: the final one alone.
  tail_steps: list[int] = dataclasses.field(default_factory=list)
  # 0: the seed's run; 1, 2, ...: the same seed trained again (train_seeds.py --repeats).
  repeat: int = 0

  @property
  def final_val_loss(self) -> float:
    return self.val_losses[-1]

  @property
  def tail_val_loss(self) -> Optional[float]:
    """Mean validation loss over the tail evaluations (None where the run stopped first)."""
    losses = dict(zip(self.eval_steps, self.val_losses, strict=True))
    steps = self.tail_steps or [self.planned_steps]
    if not all(step in losses for step in steps):
      return None
    return statistics.fmean(losses[step] for step in steps)

  def statistic(self, name: str) -> Optional[float]:
    return self.final_val_loss if name == FINAL else self.tail_val_loss

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
  """A recipe over its seeds: the runs, and the statistics of those that completed (repeats
  left out)."""

  recipe: str
  runs: tuple[RecipeResult, ...]
  loss: Optional[stats.Summary]  # final validation loss over the completed seeds
  # Per-seed relative gap to bf16 of the same seed (both completed): mean, sd, paired
  # t-interval.
  gap: Optional[stats.Summary]
  tail_loss: Optional[stats.Summary] = None  # the same for the tail-mean validation loss
  tail_gap: Optional[stats.Summary] = None

  @property
  def completed_seeds(self) -> list[int]:
    return [r.seed for r in self.runs if r.completed]


def seed_runs(results: list[RecipeResult]) -> list[RecipeResult]:
  """Each recipe's first run of each seed (the lowest repeat there is): what statistics
  over seeds are taken on."""
  first = {}
  for r in results:
    key = (r.recipe, r.seed)
    if key not in first or r.repeat < first[key].repeat:
      first[key] = r
  return [r for r in results if first[(r.recipe, r.seed)] is r]


def _losses(results: list[RecipeResult], recipe: str, statistic: str = FINAL) -> dict[int, float]:
  """recipe's statistic by seed, of the seed runs that completed (and made the evaluations
  it needs)."""
  runs = [r for r in seed_runs(results) if r.recipe == recipe and r.completed]
  values = {r.seed: r.statistic(statistic) for r in runs}
  return {seed: value for seed, value in values.items() if value is not None}


def paired_gap(
  results: list[RecipeResult], recipe: str, baseline: str, statistic: str = FINAL
) -> Optional[stats.Summary]:
  """recipe's relative gap to baseline, taken per seed (both completed) and summarized:
  mean, sd and the paired t-interval; None without a common seed."""
  losses = _losses(results, recipe, statistic)
  reference = _losses(results, baseline, statistic)
  gaps = [relative_gap(loss, reference[seed]) for seed, loss in losses.items() if seed in reference]
  return stats.summarize(gaps) if gaps else None


def _summary_of(values: list[float]) -> Optional[stats.Summary]:
  return stats.summarize(values) if values else None


def summarize(results: list[RecipeResult]) -> list[RecipeSummary]:
  """One summary per recipe (the noise band's runs are not a recipe), in the order the
  recipes first ran."""
  by_recipe: dict[str, list[RecipeResult]] = {}
  for r in seed_runs(results):
    if r.recipe != NOISE_BAND:
      by_recipe.setdefault(r.recipe, []).append(r)
  return [
    RecipeSummary(
      recipe,
      tuple(runs),
      _summary_of(list(_losses(results, recipe, FINAL).values())),
      paired_gap(results, recipe, PLAIN_RECIPE, FINAL),
      _summary_of(list(_losses(results, recipe, TAIL).values())),
      paired_gap(results, recipe, PLAIN_RECIPE, TAIL),
    )
    for recipe, runs in by_recipe.items()
  ]


def has_tail(results: list[RecipeResult]) -> bool:
  """Whether the tail-mean differs from the final loss at all (more than one tail eval)."""
  return any(len(r.tail_steps) > 1 for r in results)


@dataclasses.dataclass(frozen=True)
class RunToRun:
  """How far runs of one seed end apart (train_seeds.py --repeats): the pooled sd over
  repeats, relative to the mean, against the sd over seeds (first runs only)."""

  recipe: str
  seeds: int  # seeds trained more than once
  runs: int  # runs of those seeds, in all
  final_sd: float  # relative; sqrt of the mean over seeds of the variance over repeats
  tail_sd: Optional[float]
  seed_sd: Optional[float]  # relative sd of the final loss over seeds (first runs)


def _pooled_relative_sd(groups: list[list[float]]) -> float:
  variances = [statistics.variance(g) for g in groups]
  mean = statistics.fmean(v for g in groups for v in g)
  return (statistics.fmean(variances) ** 0.5) / mean


def run_to_run(results: list[RecipeResult]) -> list[RunToRun]:
  """Per recipe with a seed trained more than once (completed runs only)."""
  spreads = []
  for summary in summarize(results):
    by_seed: dict[int, list[RecipeResult]] = {}
    for r in results:
      if r.recipe == summary.recipe and r.completed:
        by_seed.setdefault(r.seed, []).append(r)
    repeated = [runs for runs in by_seed.values() if len(runs) > 1]
    if not repeated:
      continue
    tails = [[r.tail_val_loss for r in runs] for runs in repeated]
    loss = summary.loss
    spreads.append(
      RunToRun(
        summary.recipe,
        len(repeated),
        sum(map(len, repeated)),
        _pooled_relative_sd([[r.final_val_loss for r in runs] for runs in repeated]),
        _pooled_relative_sd(tails) if has_tail(results) else None,
        None if loss is None or loss.std is None else loss.std / loss.mean,
      )
    )
  return spreads


@dataclasses.dataclass(frozen=True)
class NoiseBand:
  """Gaps of bf16 from other seeds to bf16 of the first seed, at each evaluation both made:
  the spread of a single-seed gap with no quantization at all."""

  reference_seed: int
  seeds: tuple[int, ...]
  steps: list[int]
  gaps: np.ndarray  # [seeds, steps], relative
  # A 95% prediction half-width for one such gap at the last step: t(0.975, m) times the
  # root mean square of the m gaps (their mean is zero by construction of the question).
  half_width: float


def noise_band(results: list[RecipeResult]) -> Optional[NoiseBand]:
  reference = next(
    (r for r in seed_runs(results) if r.recipe == PLAIN_RECIPE and r.completed), None
  )
  others = [r for r in seed_runs(results) if r.recipe == NOISE_BAND and r.completed]
  if reference is None or not others:
    return None
  base = dict(zip(reference.eval_steps, reference.val_losses, strict=True))
  steps = [s for s in _common_curve(others)[0] if s and s in base]
  gaps = np.array(
    [
      [dict(zip(r.eval_steps, r.val_losses, strict=True))[s] / base[s] - 1 for s in steps]
      for r in others
    ]
  )
  final = np.array([r.final_val_loss / reference.final_val_loss - 1 for r in others])
  t = stats.student_t_quantile(stats.CONFIDENCE, len(final))
  half_width = float(t * np.sqrt(np.mean(final**2)))
  return NoiseBand(reference.seed, tuple(r.seed for r in others), steps, gaps, half_width)


def _summary_json(summary: Optional[stats.Summary]) -> Optional[dict]:
  return None if summary is None else dataclasses.asdict(summary)


def seeds_for_target(gap: Optional[stats.Summary]) -> Optional[int]:
  """Seeds the gap's 95% interval would need for a half-width of TARGET_HALF_WIDTH, by its
  measured sd (None without one)."""
  if gap is None or gap.std is None:
    return None
  return stats.seeds_needed(gap.std, TARGET_HALF_WIDTH)


def _gap_json(gap: Optional[stats.Summary]) -> Optional[dict]:
  if gap is None:
    return None
  return {
    **dataclasses.asdict(gap),
    "half_width": gap.half_width,
    "seeds_for_target_half_width": seeds_for_target(gap),
  }


def _run_key(r: RecipeResult) -> str:
  return str(r.seed) if r.repeat == 0 else f"{r.seed}.repeat{r.repeat}"


def write_curves_json(path: pathlib.Path, results: list[RecipeResult], run_info: dict) -> None:
  """{"run": run_info, "target_half_width": TARGET_HALF_WIDTH, "recipes": {recipe:
  {"final_val_loss": summary, "gap_to_bf16": gap, "tail_val_loss": summary,
  "tail_gap_to_bf16": gap, "seeds": {seed: run}}}}, plus "suggested_nvfp4_vs_custom" (and
  its tail_ twin) when both ran, "run_to_run" with repeated seeds and "noise_band" with
  NOISE_BAND runs. A summary is {n, mean, std, interval}; a gap adds its half_width and
  the seeds its interval needs for the target half-width. Repeats are keyed
  "<seed>.repeat<r>"."""
  payload = {"run": run_info, "target_half_width": TARGET_HALF_WIDTH, "recipes": {}}
  recipe, baseline = POLICY_COMPARISON
  for statistic, prefix in ((FINAL, ""), (TAIL, "tail_")):
    comparison = paired_gap(results, recipe, baseline, statistic)
    if comparison is not None:
      payload[f"{prefix}{recipe}_vs_{baseline}"] = _gap_json(comparison)
  spreads = run_to_run(results)
  if spreads:
    payload["run_to_run"] = [dataclasses.asdict(spread) for spread in spreads]
  band = noise_band(results)
  if band is not None:
    payload["noise_band"] = {
      "reference_seed": band.reference_seed,
      "seeds": list(band.seeds),
      "half_width": band.half_width,
      "steps": band.steps,
      "gaps": band.gaps.tolist(),
    }
  runs_of = {}
  for r in results:
    runs_of.setdefault(r.recipe, []).append(r)
  summaries = {summary.recipe: summary for summary in summarize(results)}
  for name, runs in runs_of.items():
    summary = summaries.get(name)
    payload["recipes"][name] = {
      "final_val_loss": _summary_json(summary and summary.loss),
      "gap_to_bf16": _gap_json(summary and summary.gap),
      "tail_val_loss": _summary_json(summary and summary.tail_loss),
      "tail_gap_to_bf16": _gap_json(summary and summary.tail_gap),
      "seeds": {
        _run_key(r): {
          **dataclasses.asdict(r),
          "final_val_loss": r.final_val_loss,
          "tail_val_loss": r.tail_val_loss,
          "completed": r.completed,
          "median_step_seconds": r.median_step_seconds,
        }
        for r in runs
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


# On a CPU every format runs as jaxquant's exact pure-JAX emulation (no FP8 or FP4
# arithmetic there): a step's time is the emulation's cost, not the format's speed.
CPU_EMULATION_NOTE = (
  "CPU: every format is emulated in pure JAX, so step times show the emulation's cost, "
  "not the formats' speed (on GPUs: docs/benchmarks.md)"
)


def title(preset: str, n_params: int, platform: str | None = None) -> str:
  heading = f"byte LM on the Python stdlib, preset {preset} ({n_params / 1e6:.1f}M parameters)"
  return heading + (f"\n{CPU_EMULATION_NOTE}" if platform == "cpu" else "")


def write_outputs(out: pathlib.Path, results: list[RecipeResult], info: dict) -> None:
  """val_loss.png, results.md and curves.json of a run; info is run_info with the recipes
  not run ("not_run") and the text results.md ends with ("notes")."""
  out.mkdir(parents=True, exist_ok=True)
  platform = info.get("platform")  # absent from runs recorded before it was
  heading = title(info["preset"], info["parameters"], platform)
  entropy = info["unigram_entropy_nats"]
  write_curves_json(out / CURVES_JSON, results, info)
  plot_validation_curves(out / CURVES_PNG, results, entropy, heading)
  notes = (f"{CPU_EMULATION_NOTE}.\n\n" if platform == "cpu" else "") + info["notes"]
  write_results_table(
    out / RESULTS_TABLE,
    results,
    info["not_run"],
    entropy,
    title(info["preset"], info["parameters"]),
    notes,
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
  band = noise_band(results)
  if band is not None:
    # At each step, the 95% prediction band of one gap with no quantization at all.
    t = stats.student_t_quantile(stats.CONFIDENCE, len(band.seeds))
    width = 100 * t * np.sqrt(np.mean(band.gaps**2, axis=0))
    gaps.fill_between(
      band.steps,
      -width,
      width,
      color="gray",
      alpha=0.25,
      linewidth=0,
      label=f"noise: 95% band of bf16 from {len(band.seeds)} other seeds "
      f"(±{band.half_width:.2%} at the end)",
    )
    gaps.legend(loc="upper right", fontsize="small")
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


def _gap_text(gap: Optional[stats.Summary], band: Optional[float] = None) -> str:
  if gap is None:
    return "n/a"
  if gap.interval is None:
    inside = band is not None and abs(gap.mean) <= band
    return f"{gap.mean:+.2%}" + (" (within noise)" if inside else "")
  return f"{gap.mean:+.2%} [{gap.interval[0]:+.2%}, {gap.interval[1]:+.2%}]"


def _seeds_text(gap: Optional[stats.Summary]) -> str:
  needed = seeds_for_target(gap)
  return "n/a" if needed is None else str(needed)


def results_table(results: list[RecipeResult], not_run: list[str], unigram_entropy: float) -> str:
  """Gaps are relative to bf16's final loss (and tail-mean loss) of the same seed, between
  runs that completed."""
  summaries = summarize(results)
  seeds = sorted({r.seed for r in seed_runs(results) if r.recipe != NOISE_BAND})
  several = len(seeds) > 1
  tail = has_tail(results)
  band = noise_band(results)
  tail_evals = max((len(r.tail_steps) for r in results), default=1)
  target = f"±{TARGET_HALF_WIDTH:.1%}"
  header = (
    "| recipe | seeds completed | final val loss (nats)"
    + (", mean ± sd" if several else "")
    + " | spread (sd / mean) | gap to bf16"
    + (", mean [95% CI]" if several else "")
    + (f" | seeds for {target}" if several else "")
  )
  if tail:
    header += f" | gap of the mean of the last {tail_evals} evals" + (
      f", mean [95% CI] | seeds for {target}" if several else ""
    )
  header += " | median step (ms) | first step, compile incl. (s) | recipe wall time (s) |"
  columns = header.count("|") - 1
  lines = [header, "|" + " --- |" * columns]
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
    band_width = None if band is None or summary.recipe == PLAIN_RECIPE else band.half_width
    cells = [
      summary.recipe,
      f"{len(summary.completed_seeds)} of {len(runs)}",
      loss_text,
      spread,
      _gap_text(summary.gap, band_width),
    ]
    baseline = summary.recipe == PLAIN_RECIPE  # its gap is zero by construction
    if several:
      cells.append("" if baseline else _seeds_text(summary.gap))
    if tail:
      cells.append(_gap_text(summary.tail_gap))
      if several:
        cells.append("" if baseline else _seeds_text(summary.tail_gap))
    step_ms = 1e3 * statistics.median(s for r in runs for s in r.window_step_seconds)
    cells += [
      f"{step_ms:.1f}",
      f"{runs[0].compile_seconds:.1f}",
      f"{sum(r.wall_seconds for r in runs):.0f}",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  if band is not None:  # its runs, with their cost, under the recipes
    others = [r for r in seed_runs(results) if r.recipe == NOISE_BAND and r.completed]
    cells = [
      NOISE_BAND,
      f"{len(others)} (seeds {', '.join(map(str, band.seeds))})",
      ", ".join(f"{r.final_val_loss:.4f}" for r in others),
      "n/a",
      f"±{band.half_width:.2%} (95% band)",
    ]
    cells += [""] * (columns - len(cells) - 3)
    cells += [
      f"{1e3 * statistics.median(s for r in others for s in r.window_step_seconds):.1f}",
      "(bf16's steps)",
      f"{sum(r.wall_seconds for r in others):.0f}",
    ]
    lines.append("| " + " | ".join(cells) + " |")
  lines.extend(f"| {name} | not run |" + " n/a |" * (columns - 2) for name in not_run)
  lines.append("")
  if band is not None:
    gaps = ", ".join(
      f"seed {seed} {gap:+.2%}" for seed, gap in zip(band.seeds, band.gaps[:, -1], strict=True)
    )
    lines.append(
      f"Noise band: bf16 trained from {len(band.seeds)} other seeds ended {gaps} from bf16 "
      f"of seed {band.reference_seed}. A single-seed gap within ±{band.half_width:.2%} (the "
      f"95% prediction band those give one gap with no quantization at all: t(0.975, "
      f"{len(band.seeds)}) times their root mean square) is what a change of seed alone "
      'does, so it says nothing about the recipe ("within noise"); val_loss.png shades '
      "that band at every evaluation. Several seeds a recipe give an interval instead "
      "(--seeds, train_seeds.py)."
    )
    lines.append("")
  if tail:
    lines.append(
      f"Tail: the mean validation loss over the last {tail_evals} evaluations (steps "
      + ", ".join(map(str, max((r.tail_steps for r in results), key=len)))
      + "), where the learning rate has decayed; its gaps are taken per seed like the final "
      "loss's."
    )
    lines.append("")
  if several:
    lines.append(
      f"Seeds {', '.join(map(str, seeds))}: each sets the initial parameters and the "
      "data order, the same for every recipe. A recipe's gap is taken per seed, to "
      "bf16 of the same seed, then averaged; its 95% interval is the paired "
      "t-interval of those per-seed gaps (mean ± t(0.975, n-1) sd / sqrt(n)). "
      "Spread: the sample standard deviation of the final loss over seeds, "
      f"relative to its mean. Seeds for {target}: how many seeds the interval would need "
      f"for a half-width of {TARGET_HALF_WIDTH:.1%}, by the sd of the per-seed gaps measured "
      "here (the smallest n with t(0.975, n-1) sd / sqrt(n) <= that)."
    )
    lines.append("")
    lines += [
      "| recipe | " + " | ".join(f"seed {s}" for s in seeds) + " |",
      "| --- | " + " | ".join("---" for _ in seeds) + " |",
    ]
    baseline = _losses(results, PLAIN_RECIPE)
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
  spreads = run_to_run(results)
  if spreads:
    lines += [
      "Run to run: seeds trained more than once (train_seeds.py --repeats) end apart by the "
      "GPU's non-determinism alone (none with --set deterministic=true); the pooled sd over "
      "repeats, relative to the mean, against the sd over seeds (first runs).",
      "",
      "| recipe | seeds repeated | runs | run-to-run sd, final | run-to-run sd, tail "
      "| seed-to-seed sd, final |",
      "| --- | --- | --- | --- | --- | --- |",
    ]
    for spread in spreads:
      tail_sd = "n/a" if spread.tail_sd is None else f"{spread.tail_sd:.2%}"
      seed_sd = "n/a" if spread.seed_sd is None else f"{spread.seed_sd:.2%}"
      lines.append(
        f"| {spread.recipe} | {spread.seeds} | {spread.runs} | {spread.final_sd:.2%} | "
        f"{tail_sd} | {seed_sd} |"
      )
    lines.append("")
  recipe, baseline = POLICY_COMPARISON
  comparison = paired_gap(results, recipe, baseline)
  if comparison is not None:
    tail_comparison = paired_gap(results, recipe, baseline, TAIL) if tail else None
    lines.append(
      f"{recipe} against {baseline} (the same number of modules in bf16, chosen by "
      f"the sensitivity analysis instead of by layer), per seed then averaged: "
      f"{_gap_text(comparison)}"
      + (" (95% paired t-interval)." if comparison.interval else ".")
      + (
        f" On the tail-mean loss: {_gap_text(tail_comparison)}."
        if tail_comparison is not None
        else ""
      )
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

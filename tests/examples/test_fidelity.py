"""The example's gap statistics, train_seeds.py's (seed, recipe) scheduler and the merge of
partial runs: against hand-computed values and a fake trainer, no training."""

import json
import pathlib
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import merge_runs  # noqa: E402  (needs examples/ on the path)
import train_seeds  # noqa: E402
from lm import presets, report, stats, suggested  # noqa: E402

STEPS = 100


def _run(recipe, seed, losses_at, repeat=0, tail=(), steps=STEPS):
  """A run with validation losses {step: loss}."""
  eval_steps = sorted(losses_at)
  return report.RecipeResult(
    recipe,
    planned_steps=steps,
    eval_steps=eval_steps,
    val_losses=[losses_at[s] for s in eval_steps],
    train_losses=[],
    window_step_seconds=[0.01],
    compile_seconds=1.0,
    seed=seed,
    tail_steps=list(tail),
    repeat=repeat,
  )


def test_tail_gap_is_the_paired_gap_of_the_mean_of_the_tail_evaluations():
  # bf16 and fp8 over three seeds, evaluated at 0, 50 (not in the tail) and 80, 90, 100.
  bf16 = {0: [2.0, 1.9, 1.8], 1: [2.1, 1.95, 1.85], 2: [2.05, 1.9, 1.82]}
  fp8 = {0: [2.02, 1.93, 1.79], 1: [2.1, 1.97, 1.9], 2: [2.0, 1.92, 1.84]}
  results = [
    _run(name, seed, {0: 5.5, 50: 3.0, 80: a, 90: b, 100: c}, tail=(80, 90, 100))
    for name, table in (("bf16", bf16), ("fp8_current", fp8))
    for seed, (a, b, c) in table.items()
  ]
  # By hand: tail means, per-seed ratios, t(0.975, 2) = 4.302653.
  gaps = [sum(fp8[s]) / sum(bf16[s]) - 1 for s in range(3)]
  mean = sum(gaps) / 3
  sd = (sum((g - mean) ** 2 for g in gaps) / 2) ** 0.5
  tail = report.paired_gap(results, "fp8_current", "bf16", report.TAIL)
  assert tail.n == 3 and tail.mean == pytest.approx(mean, rel=1e-12)
  assert tail.std == pytest.approx(sd, rel=1e-12)
  assert tail.half_width == pytest.approx(4.302653 * sd / 3**0.5, rel=1e-6)
  final = report.paired_gap(results, "fp8_current", "bf16", report.FINAL)
  assert final.mean == pytest.approx(np.mean([fp8[s][2] / bf16[s][2] - 1 for s in range(3)]))
  # A run stopped before its tail has no tail statistic, and drops out of the gap.
  stopped = _run("fp8_current", 3, {0: 5.5, 50: 3.0, 80: 1.9}, tail=(80, 90, 100))
  assert stopped.tail_val_loss is None and not stopped.completed
  assert report.paired_gap(results + [stopped], "fp8_current", "bf16", report.TAIL).n == 3
  # A run without tail steps (results written before they existed): the final loss.
  assert _run("bf16", 0, {0: 5.0, 100: 1.7}).tail_val_loss == 1.7
  table = report.results_table(results, [], 3.0)
  assert "gap of the mean of the last 3 evals" in table and "(steps 80, 90, 100)" in table


def test_seeds_needed_matches_the_t_table():
  # sd 0.95 %, target 0.5 %: 16 seeds give t(15) = 2.131 -> 0.506 %, 17 give t(16) =
  # 2.120 -> 0.488 %.
  assert stats.seeds_needed(0.0095, 0.005) == 17
  # sd 0.1 %: 2 seeds give 12.706 * 0.1 / 1.414 = 0.90 %, 3 give 4.303 * 0.1 / 1.732 = 0.25 %.
  assert stats.seeds_needed(0.001, 0.005) == 3
  assert stats.seeds_needed(0.0, 0.005) == 2
  for n in (5, 17, 40):  # the answer is the first n that reaches it, n - 1 does not
    sd = 0.005 * n**0.5 / stats.student_t_quantile(0.95, n - 1) * 0.999
    assert stats.seeds_needed(sd, 0.005) == n
  with pytest.raises(ValueError):
    stats.seeds_needed(0.01, 0.0)


def test_tail_steps_end_at_the_last_step_and_must_fit():
  train = presets.PRESETS["gpu_seeds"].train
  assert train.tail_steps() == [2600, 2700, 2800, 2900, 3000]
  assert presets.PRESETS["cpu"].train.tail_steps() == [presets.PRESETS["cpu"].train.steps]
  with pytest.raises(ValueError, match="do not fit"):
    presets.TrainConfig(
      8, steps=10, warmup_steps=1, peak_learning_rate=1e-3, tail_evals=3, tail_eval_every=5
    ).tail_steps()


class FakeProcess:
  """Ends `seconds` after it starts on the fake clock, with `code`."""

  def __init__(self, clock, seconds, code=0):
    self.clock, self.ends, self.code, self.pid = clock, clock.now + seconds, code, -1

  def poll(self):
    return self.code if self.clock.now >= self.ends else None

  @property
  def returncode(self):
    return self.poll()


class FakeClock:
  def __init__(self, step=1.0):
    self.now, self.step = 0.0, step

  def __call__(self):
    self.now += self.step  # every look at the clock is a second of work
    return self.now


def _schedule(jobs, seconds, budget, slots=2, failing=(), monkeypatch=None, **run):
  clock = FakeClock()
  started, stopped = [], []
  monkeypatch.setattr(train_seeds, "POLL_SECONDS", 0)
  monkeypatch.setattr(train_seeds, "stop", lambda process: stopped.append(process))

  def start(job, slot, time_left):
    started.append((job, time_left))
    return FakeProcess(clock, seconds[job.recipe], 1 if job in failing else 0)

  scheduler = train_seeds.Scheduler([None] * slots, start, budget, clock)
  scheduler.run(jobs, **run)
  return scheduler, started, stopped


def test_scheduler_runs_seed_by_seed_and_starts_nothing_that_cannot_end(monkeypatch):
  jobs = train_seeds.jobs_of([0, 1, 2], ["bf16", "fp8_current", "nvfp4"], repeats=1)
  assert [(j.seed, j.recipe) for j in jobs[:4]] == [
    (0, "bf16"),
    (0, "fp8_current"),
    (0, "nvfp4"),
    (1, "bf16"),
  ]
  seconds = {"bf16": 20, "fp8_current": 30, "nvfp4": 45}
  scheduler, started, stopped = _schedule(jobs, seconds, budget=150, monkeypatch=monkeypatch)
  order = [job for job, _ in started]
  assert order == jobs[: len(order)]  # queue order: complete pairs accumulate first
  assert scheduler.done and not scheduler.failed
  # Every job started within the budget ended within it: the rest was never started
  # (or stopped, if it had started before any of its recipe finished).
  assert len(scheduler.done) + len(scheduler.not_started) + len(scheduler.stopped) == len(jobs)
  assert all(left <= 150 for _, left in started)
  assert len(stopped) == len(scheduler.stopped)
  assert scheduler.elapsed() <= 150 + 5


def test_scheduler_stops_stragglers_at_the_budget(monkeypatch):
  jobs = train_seeds.jobs_of([0], ["bf16", "nvfp4"], repeats=1)
  scheduler, _, stopped = _schedule(
    jobs, {"bf16": 10, "nvfp4": 500}, budget=60, monkeypatch=monkeypatch
  )
  assert [j.recipe for j in scheduler.done] == ["bf16"]
  assert [j.recipe for j in scheduler.stopped] == ["nvfp4"] and len(stopped) == 1


def test_scheduler_waits_for_readiness_and_drops_what_depends_on_a_failure(monkeypatch):
  jobs = train_seeds.jobs_of([0, 1], ["bf16", "suggested_nvfp4"], repeats=1)
  analyser = jobs[1]
  waiting = [j for j in jobs if j.recipe == "suggested_nvfp4" and j != analyser]
  state = {}

  def ready(job):
    return job not in waiting or analyser in state["s"].done

  clock_jobs = {"bf16": 5, "suggested_nvfp4": 8}
  clock = FakeClock()
  monkeypatch.setattr(train_seeds, "POLL_SECONDS", 0)
  started = []

  def start(job, slot, left):
    started.append(job)
    return FakeProcess(clock, clock_jobs[job.recipe])

  scheduler = train_seeds.Scheduler([None] * 3, start, 1000, clock)
  state["s"] = scheduler
  scheduler.run(jobs, ready=ready)
  assert started.index(waiting[0]) > started.index(analyser)
  assert len(scheduler.done) == 4
  # The analyser fails: the suggested job waiting for its policy is dropped, not run.
  scheduler, started, _ = _schedule(
    jobs,
    clock_jobs,
    budget=1000,
    slots=3,
    failing=[analyser],
    monkeypatch=monkeypatch,
    ready=lambda job: job not in waiting,
    dropped=lambda job: job in waiting,
  )
  assert waiting[0] in scheduler.not_started and waiting[0] not in [j for j, _ in started]


def test_split_recipes_puts_bf16_first_and_takes_all_with_more():
  names, rest = train_seeds.split_recipes(
    ["--preset", "gpu_seeds", "--recipes", "all,suggested_nvfp4", "--steps", "5"]
  )
  assert names[0] == "bf16" and names[-1] == "suggested_nvfp4" and len(names) == 9
  assert rest == ["--preset", "gpu_seeds", "--steps", "5"]
  assert train_seeds.split_recipes(["--recipes=nvfp4"])[0] == ["bf16", "nvfp4"]
  job = train_seeds.Job(3, "nvfp4", repeat=2)
  assert job.folder(pathlib.Path("o")) == pathlib.Path("o/seed_3/nvfp4_repeat2")


def _info(seeds, **changes):
  return {
    "preset": "tiny",
    "seed": seeds[0],
    "seeds": seeds,
    "parameters": 1000,
    "train": {"steps": STEPS, "eval_batches": None},
    "device_kind": "cpu",
    "jax": "0.11.2",
    "unigram_entropy_nats": 3.25,
    "noise_floor_scale": None,
    "not_run": [],
    "notes": "",
    **changes,
  }


def test_merge_leaves_out_runs_without_their_seeds_bf16_and_keeps_repeats_apart(tmp_path):
  finals = {("bf16", 0): 1.70, ("bf16", 1): 1.72, ("nvfp4", 0): 1.71, ("nvfp4", 1): 1.75}
  folders = []
  for (recipe, seed), loss in finals.items():
    folder = tmp_path / f"{recipe}_{seed}"
    report.write_outputs(folder, [_run(recipe, seed, {0: 5.0, 100: loss})], _info([seed]))
    folders.append(folder)
  # nvfp4 of seed 2, whose bf16 was stopped at step 50 by the time budget.
  stopped = tmp_path / "bf16_2"
  report.write_outputs(stopped, [_run("bf16", 2, {0: 5.0, 50: 2.0})], _info([2]))
  orphan = tmp_path / "nvfp4_2"
  report.write_outputs(orphan, [_run("nvfp4", 2, {0: 5.0, 100: 1.6})], _info([2]))
  # bf16 of seed 0 again (repeat 1): run-to-run spread, not a third seed.
  again = tmp_path / "bf16_0_repeat1"
  report.write_outputs(
    again, [_run("bf16", 0, {0: 5.0, 100: 1.69}, repeat=1)], _info([0], repeat=1)
  )
  merge_runs.main([*map(str, folders + [stopped, orphan, again]), "--out", str(tmp_path / "m")])

  merged = json.loads((tmp_path / "m" / report.CURVES_JSON).read_text())
  assert merged["run"]["unpaired"] == ["nvfp4 seed 2"]
  nvfp4 = merged["recipes"]["nvfp4"]
  assert set(nvfp4["seeds"]) == {"0", "1"} and nvfp4["gap_to_bf16"]["n"] == 2
  gaps = [1.71 / 1.70 - 1, 1.75 / 1.72 - 1]
  assert nvfp4["gap_to_bf16"]["mean"] == pytest.approx(np.mean(gaps))
  assert nvfp4["gap_to_bf16"]["seeds_for_target_half_width"] == stats.seeds_needed(
    np.std(gaps, ddof=1), report.TARGET_HALF_WIDTH
  )
  bf16 = merged["recipes"]["bf16"]
  assert set(bf16["seeds"]) == {"0", "1", "2", "0.repeat1"}
  assert bf16["final_val_loss"]["n"] == 2  # seeds 0 and 1 (seed 2 stopped; the repeat apart)
  (spread,) = merged["run_to_run"]
  assert spread["recipe"] == "bf16" and spread["seeds"] == 1 and spread["runs"] == 2
  assert spread["final_sd"] == pytest.approx(np.std([1.70, 1.69], ddof=1) / 1.695)
  table = (tmp_path / "m" / report.RESULTS_TABLE).read_text()
  assert "Left out, as bf16 of their seed did not complete: nvfp4 seed 2." in table
  assert "Run to run" in table and "| seeds for ±0.5% |" in table
  # Merging a repeat twice is refused like a seed trained twice.
  with pytest.raises(SystemExit, match=r"bf16 seed 0 \(repeat 1\) trained in both"):
    merge_runs.main([str(again), str(again), "--out", str(tmp_path / "m2")])


def test_noise_band_of_bf16_from_other_seeds():
  results = [_run("bf16", 0, {0: 5.0, 50: 2.0, 100: 1.70}, tail=())]
  results += [
    _run(report.NOISE_BAND, seed, {0: 5.0, 50: 2.0 * (1 + g), 100: 1.70 * (1 + g)}, tail=())
    for seed, g in ((1, 0.01), (2, -0.02), (3, 0.015))
  ]
  results.append(_run("nvfp4", 0, {0: 5.0, 50: 2.1, 100: 1.70 * 1.02}, tail=()))
  band = report.noise_band(results)
  assert band.seeds == (1, 2, 3) and band.steps == [50, 100]
  rms = np.sqrt(np.mean(np.square([0.01, -0.02, 0.015])))
  assert band.half_width == pytest.approx(3.182446 * rms, rel=1e-5)  # t(0.975, 3)
  assert [s.recipe for s in report.summarize(results)] == ["bf16", "nvfp4"]
  table = report.results_table(results, [], 3.0)
  assert "+2.00% (within noise)" in table and f"±{band.half_width:.2%}" in table


def test_a_saved_policy_rebuilds_the_recipe_suggest_recipe_proposes(tmp_path):
  from lm import recipes

  from jaxquant import analysis
  from jaxquant.analysis import ModuleSensitivity, RoleSensitivity, SensitivityReport
  from jaxquant.quantizers import NVFP4Quantizer
  from jaxquant.roles import gemm_roles

  config = presets.PRESETS["tiny"].model
  names = [f"decoder/layer_{i}/{m}" for i in range(2) for m in ("attention/qkv", "mlp/wo")]
  sqnr = dict(zip(names, (30.0, 5.0, 25.0, 10.0), strict=True))
  modules = tuple(
    ModuleSensitivity(
      "linear",
      name,
      {"fprop": sqnr[name], "dgrad": sqnr[name], "wgrad": sqnr[name]},
      tuple(
        RoleSensitivity(role, NVFP4Quantizer(), {}, None, None)
        for role in gemm_roles("linear", name).values()
      ),
      None,
    )
    for name in names
  )
  sensitivity = SensitivityReport("nvfp4", 1.0, 1.0, modules)
  base = recipes.recipe_for("nvfp4", config)
  proposed = analysis.suggest_recipe(sensitivity, base, keep_high_precision=2)
  top = analysis.ranked_modules(sensitivity, "gemm_sqnr")[:2]
  saved = {
    "kept": [[m.module_type, m.name] for m in top],
    "seed": 0,
    "rank_by": "gemm_sqnr",
    "sensitivity_steps": 10,
  }
  suggested.write_policy(tmp_path / suggested.POLICY_FILE, saved)
  read = suggested.read_policy(tmp_path / suggested.POLICY_FILE, config)
  rebuilt = suggested.from_policy(config, read)
  assert rebuilt.recipe.qfactory.kept == proposed.qfactory.kept
  assert rebuilt.kept == tuple(m.name for m in top)
  assert rebuilt.config.scanned_layers == min(config.scanned_layers, 0)  # layer 0 kept
  (tmp_path / "bad.json").write_text('{"kept": ["decoder/layer_0/mlp/wo"]}')
  with pytest.raises(ValueError, match="not a suggested_policy.json"):
    suggested.read_policy(tmp_path / "bad.json", config)

"""examples/merge_runs.py and train_seeds.py: runs trained apart, reported as one run of
them all."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import merge_runs  # noqa: E402  (needs examples/ on the path)
from lm import report  # noqa: E402

STEPS = 20


def _result(recipe: str, seed: int, final: float) -> report.RecipeResult:
  return report.RecipeResult(
    recipe=recipe,
    planned_steps=STEPS,
    eval_steps=[0, 10, STEPS],
    val_losses=[5.5, final + 0.5, final],
    train_losses=[5.0] * STEPS,
    window_step_seconds=[0.01, 0.012],
    compile_seconds=2.0,
    wall_seconds=3.0,
    seed=seed,
  )


def _info(seeds: list[int], eval_batches=None, **changes) -> dict:
  return {
    "preset": "tiny",
    "seed": seeds[0],
    "seeds": seeds,
    "parameters": 123_456,
    "train": {"steps": STEPS, "eval_batches": eval_batches},
    "device": "cuda:0",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "jax": "0.11.2",
    "unigram_entropy_nats": 3.25,
    "noise_floor_scale": None,
    "not_run": [],
    "notes": "",
    **changes,
  }


def _write_run(
  folder: pathlib.Path, results: list[report.RecipeResult], info: dict
) -> pathlib.Path:
  report.write_outputs(folder, results, info)
  return folder


def test_merged_gaps_pair_each_seed_with_bf16_from_another_run(tmp_path):
  finals = {
    ("bf16", 0): 0.70,
    ("bf16", 1): 0.69,
    ("bf16", 2): 0.71,
    ("nvfp4", 0): 0.71,
    ("nvfp4", 1): 0.695,
    ("nvfp4", 2): 0.72,
  }
  # nvfp4's seeds 0-1 in one run, bf16 from three seeds in a second, nvfp4's seed 2 in a third.
  runs = [
    _write_run(
      tmp_path / "nvfp4_a", [_result("nvfp4", s, finals["nvfp4", s]) for s in (0, 1)], _info([0, 1])
    ),
    _write_run(
      tmp_path / "bf16",
      [_result("bf16", s, finals["bf16", s]) for s in (0, 1, 2)],
      _info([0, 1, 2]),
    ),
    _write_run(
      tmp_path / "nvfp4_b",
      [_result("nvfp4", 2, finals["nvfp4", 2])],
      _info([2], not_run=["custom"]),
    ),
  ]
  merge_runs.main([*map(str, runs), "--out", str(tmp_path / "merged")])

  merged = json.loads((tmp_path / "merged" / report.CURVES_JSON).read_text())
  assert merged["run"]["seeds"] == [0, 1, 2] and merged["run"]["merged_runs"] == 3
  assert list(merged["recipes"]) == ["bf16", "nvfp4"]
  assert merged["run"]["not_run"] == ["custom"]
  gaps = [finals["nvfp4", s] / finals["bf16", s] - 1 for s in (0, 1, 2)]
  nvfp4 = merged["recipes"]["nvfp4"]
  assert nvfp4["gap_to_bf16"]["n"] == 3
  assert nvfp4["gap_to_bf16"]["mean"] == pytest.approx(np.mean(gaps))
  half_width = 4.302653 * np.std(gaps, ddof=1) / np.sqrt(3)  # t(0.975, 2)
  assert nvfp4["gap_to_bf16"]["interval"] == pytest.approx(
    [np.mean(gaps) - half_width, np.mean(gaps) + half_width], rel=1e-5
  )
  bf16 = merged["recipes"]["bf16"]["final_val_loss"]
  assert bf16["std"] == pytest.approx(np.std([0.70, 0.69, 0.71], ddof=1))
  table = (tmp_path / "merged" / report.RESULTS_TABLE).read_text()
  assert "| bf16 | 3 of 3 |" in table and "| nvfp4 | 3 of 3 |" in table
  assert "| custom | not run |" in table
  assert (tmp_path / "merged" / report.CURVES_PNG).is_file()


def test_runs_of_another_configuration_are_refused_naming_the_field(tmp_path):
  first = _write_run(tmp_path / "a", [_result("bf16", 0, 0.7)], _info([0]))
  other_gpu = _write_run(
    tmp_path / "b", [_result("bf16", 1, 0.7)], _info([1], device_kind="NVIDIA H200")
  )
  with pytest.raises(SystemExit, match="'device_kind' is 'NVIDIA H200'.*one configuration"):
    merge_runs.main([str(first), str(other_gpu), "--out", str(tmp_path / "merged")])
  longer = _write_run(
    tmp_path / "c",
    [_result("bf16", 1, 0.7)],
    _info([1], train={"steps": 2 * STEPS, "eval_batches": None}),
  )
  with pytest.raises(SystemExit, match="'train'"):
    merge_runs.main([str(first), str(longer), "--out", str(tmp_path / "merged")])
  assert not (tmp_path / "merged").exists()


def test_a_seed_trained_twice_is_refused(tmp_path):
  a = _write_run(tmp_path / "a", [_result("bf16", 0, 0.7)], _info([0]))
  b = _write_run(tmp_path / "b", [_result("bf16", 0, 0.71)], _info([0]))
  with pytest.raises(SystemExit, match="bf16 seed 0 trained in both"):
    merge_runs.main([str(a), str(b), "--out", str(tmp_path / "merged")])


def test_sampled_validation_batches_need_the_same_validation_seed(tmp_path):
  a = _write_run(tmp_path / "a", [_result("bf16", 0, 0.7)], _info([0], eval_batches=4))
  b = _write_run(tmp_path / "b", [_result("bf16", 1, 0.7)], _info([1], eval_batches=4))
  with pytest.raises(SystemExit, match="validation seed 1, but 0 .*sampled validation batches"):
    merge_runs.main([str(a), str(b), "--out", str(tmp_path / "merged")])
  # Seed 1 validated on seed 0's batches (train_lm.py --seed 1 --validation-seed 0).
  c = _write_run(
    tmp_path / "c", [_result("bf16", 1, 0.7)], _info([1], eval_batches=4, validation_seed=0)
  )
  merge_runs.main([str(a), str(c), "--out", str(tmp_path / "merged")])


def test_suggested_policies_must_agree(tmp_path):
  a = _write_run(
    tmp_path / "a",
    [_result("suggested_nvfp4", 0, 0.7)],
    _info([0], suggested_policy=["layers_5/mlp/wo"]),
  )
  b = _write_run(
    tmp_path / "b",
    [_result("suggested_nvfp4", 1, 0.7)],
    _info([1], suggested_policy=["layers_4/attention/qkv"]),
  )
  with pytest.raises(SystemExit, match="kept different modules"):
    merge_runs.main([str(a), str(b), "--out", str(tmp_path / "merged")])
  (tmp_path / "a" / merge_runs.SENSITIVITY_FILES[0]).write_text("ranked table")
  c = _write_run(
    tmp_path / "c",
    [_result("suggested_nvfp4", 1, 0.7)],
    _info([1], suggested_policy=["layers_5/mlp/wo"]),
  )
  merge_runs.main([str(a), str(c), "--out", str(tmp_path / "merged")])
  merged = json.loads((tmp_path / "merged" / report.CURVES_JSON).read_text())
  assert merged["run"]["suggested_policy"] == ["layers_5/mlp/wo"]
  assert (tmp_path / "merged" / merge_runs.SENSITIVITY_FILES[0]).read_text() == "ranked table"


def test_suggested_runs_without_a_recorded_policy_are_refused(tmp_path):
  a = _write_run(
    tmp_path / "a",
    [_result("suggested_nvfp4", 0, 0.7)],
    _info([0], suggested_policy=["layers_5/mlp/wo"]),
  )
  b = _write_run(tmp_path / "b", [_result("suggested_nvfp4", 1, 0.7)], _info([1]))
  with pytest.raises(SystemExit, match="without recording which modules"):
    merge_runs.main([str(a), str(b), "--out", str(tmp_path / "merged")])


def test_train_seeds_trains_one_process_a_seed_and_merges_them(tmp_path):
  """The tiny preset from seeds 5 and 6, both at once on the default device."""
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
      filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")])
    ),
  }
  completed = subprocess.run(
    [
      sys.executable,
      str(EXAMPLES / "train_seeds.py"),
      "--seeds",
      "2",
      "--seed",
      "5",
      "--per-gpu",
      "2",
      "--out",
      str(tmp_path),
      "--",
      "--preset",
      "tiny",
      "--recipes",
      "bf16",
      "--steps",
      "4",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
    env=env,
  )
  assert completed.returncode == 0, completed.stdout + completed.stderr
  merged = json.loads((tmp_path / report.CURVES_JSON).read_text())
  assert merged["run"]["seeds"] == [5, 6] and merged["run"]["merged_runs"] == 2
  bf16 = merged["recipes"]["bf16"]
  assert set(bf16["seeds"]) == {"5", "6"} and bf16["final_val_loss"]["n"] == 2
  for seed in (5, 6):  # each seed's own run, as train_lm.py wrote it
    alone = json.loads((tmp_path / f"seed_{seed}" / report.CURVES_JSON).read_text())
    assert alone["run"]["seeds"] == [seed] and alone["run"]["validation_seed"] == 5
    assert (
      alone["recipes"]["bf16"]["seeds"][str(seed)]["val_losses"]
      == bf16["seeds"][str(seed)]["val_losses"]
    )


def test_train_seeds_refuses_flags_it_sets_itself(tmp_path):
  completed = subprocess.run(
    [
      sys.executable,
      str(EXAMPLES / "train_seeds.py"),
      "--seeds",
      "2",
      "--out",
      str(tmp_path),
      "--",
      "--preset",
      "tiny",
      "--seed",
      "3",
    ],
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  assert completed.returncode == 2
  assert "--seed is set by train_seeds.py" in completed.stderr

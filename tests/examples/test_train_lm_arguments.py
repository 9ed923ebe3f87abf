"""train_lm.py refuses bad input before anything runs or is written: every flag, `--set`
value, policy file and process option, with an error naming the flag, the value and the
rule. Cheap: training is stood in for by a failure, so a case that got through fails at
once instead of training."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import train_lm  # noqa: E402  (needs examples/ on the path)
from lm import distributed, suggested  # noqa: E402


class TrainingStarted(Exception):
  pass


@pytest.fixture
def no_training(monkeypatch):
  def started(*args, **kwargs):
    raise TrainingStarted

  monkeypatch.setattr(train_lm, "train_recipes", started)
  monkeypatch.setattr(distributed, "initialize", started)


def refused(tmp_path, argv, match):
  """Runs train_lm with argv into a fresh --out: it must raise, naming `match`, and leave
  --out unwritten."""
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=match):
    train_lm.main(["--preset", "tiny", "--out", str(out), *argv])
  assert not out.exists()


@pytest.mark.parametrize(
  "assignment, rule",
  [
    ("batch_size=0", "batch_size must be an integer >= 1, got 0"),
    ("peak_learning_rate=nan", "peak_learning_rate must be a finite number > 0, got nan"),
    ("peak_learning_rate=-1e-3", "peak_learning_rate must be a finite number > 0"),
    (
      "final_learning_rate_fraction=2",
      r"final_learning_rate_fraction must be a number in \[0, 1\]",
    ),
    ("eval_every=0", "eval_every must be an integer >= 1"),
    ("eval_batches=0", "eval_batches must be an integer >= 1, or all"),
    ("grad_clip_norm=inf", "grad_clip_norm must be a finite number > 0"),
  ],
)
def test_a_bad_set_value_is_refused(tmp_path, no_training, assignment, rule):
  refused(tmp_path, ["--set", assignment], f"--set '{assignment}': {rule}")


@pytest.mark.parametrize(
  "argv, match",
  [
    (["--noise-band", "-1"], "--noise-band -1: a number of runs, >= 0"),
    (["--time-budget-s", "-1"], r"--time-budget-s -1.0: a finite number of seconds > 0"),
    (["--time-budget-s", "nan"], r"--time-budget-s nan: a finite number of seconds > 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--repeat-index", "-1"], "--repeat-index -1"),
    (["--num-processes", "0"], "--num-processes 0: a job has at least 1 process"),
    (["--process-id", "5", "--num-processes", "2"], r"--process-id 5 --num-processes 2: .*0\.\.1"),
    (["--process-id", "-1"], "--process-id -1"),
    (["--recipes", "bf16,no_such_recipe"], "unknown recipe"),
    (["--quantized-gather"], "--quantized-gather .* needs --mesh"),
  ],
)
def test_a_bad_flag_is_refused(tmp_path, no_training, argv, match):
  refused(tmp_path, argv, match)


def policy(tmp_path, text: str) -> str:
  path = tmp_path / suggested.POLICY_FILE
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize("recipe", ["suggested_nvfp4", "bf16"])  # used or not, it is read
@pytest.mark.parametrize(
  "text, match",
  [
    ("", "not a suggested_policy.json \\(not JSON"),
    ("{not json", "not a suggested_policy.json \\(not JSON"),
    ('["decoder/layer_0/mlp/wi"]', "not a suggested_policy.json \\('kept'"),
    (
      json.dumps({"kept": [["linear", "decoder/layer_7/mlp/wi"]], "seed": 0}),
      r"keeps modules this model \(2 layers\) does not have: \[\['linear', 'decoder/layer_7",
    ),
  ],
  ids=["empty", "corrupt", "not_a_policy", "unknown_module"],
)
def test_a_bad_policy_file_is_refused_naming_the_flag_and_file(
  tmp_path, no_training, recipe, text, match
):
  path = policy(tmp_path, text)
  refused(
    tmp_path,
    ["--recipes", recipe, "--suggested-policy", path],
    f"--suggested-policy {path}: {match}",
  )


def test_a_missing_policy_file_is_refused(tmp_path, no_training):
  refused(
    tmp_path,
    ["--suggested-policy", str(tmp_path / "nowhere.json")],
    "--suggested-policy .*nowhere.json: cannot be read",
  )


def test_a_good_policy_file_gets_through(tmp_path, no_training):
  kept = json.dumps({"kept": [["linear", "decoder/layer_1/mlp/wi"]], "seed": 0})
  with pytest.raises(TrainingStarted):
    train_lm.main(
      [
        "--preset",
        "tiny",
        "--out",
        str(tmp_path / "o"),
        "--suggested-policy",
        policy(tmp_path, kept),
      ]
    )


def test_an_earlier_run_s_outputs_are_kept_unless_overwrite(tmp_path, no_training):
  out = tmp_path / "earlier"
  out.mkdir()
  (out / "curves.json").write_text("{}")
  (out / "train_lm.log").write_text("")  # a folder holding other files is fine
  with pytest.raises(
    ValueError, match=f"--out {out}: holds an earlier run's curves.json; .*--overwrite"
  ):
    train_lm.main(["--preset", "tiny", "--out", str(out)])
  assert (out / "curves.json").read_text() == "{}"
  with pytest.raises(TrainingStarted):
    train_lm.main(["--preset", "tiny", "--out", str(out), "--overwrite"])
  with pytest.raises(TrainingStarted):
    train_lm.main(["--preset", "tiny", "--out", str(tmp_path / "other")])


def test_the_default_output_folder_is_each_command_s_own_outside_the_package():
  cpu, tiny = train_lm.parse_args([]).out, train_lm.parse_args(["--preset", "tiny"]).out
  assert cpu.parent == tiny.parent == train_lm.DEFAULT_RUNS
  assert cpu.name.startswith("cpu-") and tiny.name.startswith("tiny-")
  assert not cpu.resolve().is_relative_to((ROOT / "examples").resolve())

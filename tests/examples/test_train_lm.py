"""The language-model example runs end to end (tiny preset, bf16) and learns something."""

import collections
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from lm import data, recipes  # noqa: E402  (importable only once examples/ is on the path)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[pathlib.Path, str]:
  out = tmp_path_factory.mktemp("train_lm")
  completed = subprocess.run(
      [sys.executable, str(EXAMPLES / "train_lm.py"), "--preset", "tiny", "--recipes", "bf16",
       "--out", str(out)],
      capture_output=True, text=True, timeout=240, check=False)
  assert completed.returncode == 0, completed.stdout + completed.stderr
  return out, completed.stdout


def test_writes_all_outputs(tiny_run):
  out, _ = tiny_run
  for name in ("val_loss.png", "results.md", "curves.json"):
    assert (out / name).stat().st_size > 0, name
  assert "| bf16 |" in (out / "results.md").read_text()


def test_loss_decreases_below_initial(tiny_run):
  out, stdout = tiny_run
  curves = json.loads((out / "curves.json").read_text())
  bf16 = curves["recipes"]["bf16"]
  assert bf16["val_losses"][-1] < bf16["val_losses"][0] - 0.5
  assert "unigram byte entropy" in stdout


def test_validation_split_is_deterministic_and_disjoint():
  root = data.load_stdlib_corpus().root
  files = [p.relative_to(root).as_posix() for p in data.stdlib_source_files(root)]
  assert files == sorted(files)
  assert not any("site-packages" in f or "/test/" in f"/{f}" for f in files)
  validation = [f for f in files if data.is_validation_file(f, 10)]
  assert 0 < len(validation) < len(files) / 5
  assert validation == [f for f in files if data.is_validation_file(f, 10)]


def test_train_windows_repeat_for_the_same_seed():
  tokens = (np.arange(1000) % 256).astype(np.uint8)
  first = next(data.train_batches(tokens, seed=3, batch_size=4, seq_len=8))
  again = next(data.train_batches(tokens, seed=3, batch_size=4, seq_len=8))
  assert (first == again).all() and first.shape == (4, 9)


def test_custom_policy_keeps_the_last_layer_and_head_in_bf16():
  Role = collections.namedtuple("Role", "module_type tensor_type name")
  qfactory = recipes.nvfp4_with_bf16_tail(n_layers=4, nvfp4_factory=lambda role: "nvfp4")
  assert qfactory(Role("linear", "weight", "decoder/layer_2/mlp/wi")) == "nvfp4"
  assert qfactory(Role("linear", "input", "decoder/layer_3/attention/query")) is None
  assert qfactory(Role("linear", "weight", "head")) is None


def test_recipe_names():
  assert recipes.parse_recipe_names("all") == list(recipes.RECIPE_NAMES)
  with pytest.raises(ValueError, match="unknown recipe"):
    recipes.parse_recipe_names("fp9")

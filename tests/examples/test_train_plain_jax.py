"""examples/train_plain_jax.py end to end, tiny: a plain-JAX GPT under jaxquant.quantize
trains under a current- and a delayed-scaling recipe, beside bf16."""

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import train_plain_jax  # noqa: E402  (needs examples/ on the path)


def test_trains_and_compares_recipes(capsys):
  tiny = ["--steps", "3", "--batch", "4", "--seq-len", "32", "--d-model", "64", "--layers", "1"]
  results = train_plain_jax.main([*tiny, "--eval-batches", "1", "--recipes", "bf16,fp8_delayed"])
  assert sorted(results) == ["bf16", "fp8_delayed"]
  assert all(np.isfinite(v) and v < np.log(256) for v in results.values()), results
  printed = capsys.readouterr().out
  assert "fp8_delayed: train loss" in printed and "vs bf16" in printed

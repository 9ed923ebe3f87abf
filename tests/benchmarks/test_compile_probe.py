"""benchmarks/compile_probe.py on the CPU: which suspects apply to which variant, and a short
run prints a compile time for each variant and each suspect that applies."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
import compile_probe  # noqa: E402
import step_variants  # noqa: E402


@pytest.fixture(scope="module")
def probe():
  return compile_probe.Probe("tiny", 1, "xla")


@pytest.mark.parametrize(
  "name,suspects",
  [
    ("bf16", []),
    ("fp8_current", []),
    ("fp8_delayed", ["delayed_update"]),
    ("nvfp4", ["role_keys", "fold_in"]),  # stochastic rounding of the output gradients
  ],
)
def test_suspects_apply_where_the_variant_has_them(probe, name, suspects):
  variant = step_variants.build(name, probe.stock)
  assert [s for s in compile_probe.SUSPECTS if probe.applies(s, variant)] == suspects


def test_removing_a_suspect_changes_the_traced_step(probe):
  """Each suspect taken out leaves a step without it: no state update (the collections come
  back as the forward pass left them), no role fold_in, no fold_in at all."""
  import jax

  variant = step_variants.build("nvfp4", probe.stock)
  count = lambda context: _fold_ins(probe, variant, context)
  whole, without_roles, without_any = (
    count(compile_probe.SUSPECTS[s][1]) for s in ("delayed_update", "role_keys", "fold_in")
  )
  assert whole > without_roles > without_any == 0
  delayed = step_variants.build("fp8_delayed", probe.stock)
  kept = compile_probe.SUSPECTS["delayed_update"][0](delayed)
  args = probe._args(delayed)
  text = lambda v: str(jax.make_jaxpr(compile_probe.step.train_step(v, probe.tx))(*args))
  assert text(kept).count("reduce_max") < text(delayed).count("reduce_max")


def _fold_ins(probe, variant, context):
  import jax

  args = probe._args(variant)
  jax.clear_caches()  # helpers' traces are cached by function, whatever was patched
  with context():
    jaxpr = str(jax.make_jaxpr(compile_probe.step.train_step(variant, probe.tx))(*args))
  return jaxpr.count("random_fold_in")


def test_main_prints_each_variant_and_suspect(capsys):
  compile_probe.main(
    ["--shape", "tiny", "--layers", "1", "--only", "bf16,fp8_delayed", "--repeats", "1"]
  )
  lines = capsys.readouterr().out.strip().splitlines()
  assert [re.sub(r"\s+[\d.]+ s$", "", line).split() for line in lines] == [
    ["bf16"],
    ["fp8_delayed"],
    ["fp8_delayed", "without", "delayed_update"],
  ]

"""train_lm.py as one job of 2 processes x 4 CPU devices (examples/launch_local.py,
jax.distributed over gloo) trains as one process does on 8 devices, on the same mesh.

Both runs shard the program alike; only the collectives differ (gloo between the
processes, in-process copies within one), which may sum in another order: fp32
rounding. So the losses are compared as tests/examples/test_sharded_lm.py compares a
sharded run with one device's: the first losses (the forward pass of the same params on
the same batch) and all of bf16's to RTOL, the later losses of the quantized recipe to
RTOL_TRAINED. A process that fed other data or other params (its own seed, say) moves its
half of the batch's loss, and the mean, by tenths of a nat.

CI time: compilation is the cost (each of the three processes compiles both recipes'
steps), so the tiny preset runs 2 steps, XLA's backend optimizations are off (both runs
alike), and the one-process run goes on beside the job.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
RTOL = 1e-5
RTOL_TRAINED = 1e-3
RECIPES = ("bf16", "fp8_current")
COMMAND = [
  sys.executable,
  str(ROOT / "examples" / "train_lm.py"),
  "--preset",
  "tiny",
  "--recipes",
  ",".join(RECIPES),
  "--steps",
  "2",
  "--mesh",
  "fsdp=4,tensor=2",
]
TIMEOUT_S = 600


def _environment(xla_flags: str) -> dict[str, str]:
  path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
  flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"])
  return dict(
    os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} {xla_flags}".strip()
  )


def _start(command: list[str], xla_flags: str = "") -> subprocess.Popen:
  return subprocess.Popen(
    command,
    cwd=ROOT,
    env=_environment(xla_flags),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _finish(process: subprocess.Popen) -> str:
  output, _ = process.communicate(timeout=TIMEOUT_S)
  assert process.returncode == 0, output[-5000:]
  return output


def _losses(out: pathlib.Path) -> dict[str, tuple[list[float], list[float]]]:
  recipes = json.loads((out / "curves.json").read_text())["recipes"]
  return {
    name: (recipe["seeds"]["0"]["train_losses"], recipe["seeds"]["0"]["val_losses"])
    for name, recipe in recipes.items()
  }


def test_two_processes_train_as_one_process_on_the_same_mesh(tmp_path):
  one, two = tmp_path / "one_process", tmp_path / "two_processes"
  # The launcher replaces the device count the XLA_FLAGS of this test session give.
  single = _start([*COMMAND, "--out", str(one)], "--xla_force_host_platform_device_count=8")
  job = _start(
    [
      sys.executable,
      str(ROOT / "examples" / "launch_local.py"),
      "--processes",
      "2",
      "--cpu-devices-per-process",
      "4",
      "--",
      *COMMAND,
      "--out",
      str(two),
    ]
  )
  single_output, job_output = _finish(single), _finish(job)

  assert "on mesh data=1,fsdp=4,tensor=2 of 8 x cpu in 2 processes" in job_output
  assert "on mesh data=1,fsdp=4,tensor=2 of 8 x cpu," in single_output
  # Process 0 reports; process 1 ran the same steps silently.
  assert "[0] bf16: final validation loss" in job_output
  assert "[1] bf16" not in job_output and "[1] model:" not in job_output

  expected, got = _losses(one), _losses(two)
  assert sorted(got) == sorted(expected) == sorted(RECIPES)
  for name in RECIPES:
    (expected_train, expected_val), (train, val) = expected[name], got[name]
    assert len(train) == len(expected_train) == 2 and len(val) == len(expected_val) == 2
    later_rtol = RTOL if name == "bf16" else RTOL_TRAINED
    np.testing.assert_allclose(train[0], expected_train[0], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(val[0], expected_val[0], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(train[1:], expected_train[1:], rtol=later_rtol, err_msg=name)
    np.testing.assert_allclose(val[1:], expected_val[1:], rtol=later_rtol, err_msg=name)

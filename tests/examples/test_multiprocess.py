"""train_lm.py as one job of 2 processes x 4 CPU devices (examples/launch_local.py,
jax.distributed over gloo) trains as one process does on 8 devices, on the same mesh.

Both runs shard the program alike; only the collectives differ (gloo between the
processes, in-process copies within one), which may sum in another order: fp32
rounding. So the losses are compared as tests/examples/test_sharded_lm.py compares a
sharded run with one device's: the first losses (the forward pass of the same params on
the same batch) to RTOL, the later losses of the quantized recipe to RTOL_TRAINED.
Measured: the two runs differ by at most 1e-7 relative; one process of another seed
(other params, other batches) moves the first loss by 9e-4, ninety times RTOL. One recipe,
per-tensor FP8, whose amaxes are reduced across both processes (test_sharded_lm.py covers
every recipe on one process's mesh).

CI time: compilation is the cost (each of the three processes compiles the recipe's
steps), so the tiny preset runs 2 steps of one decoder layer and XLA's backend
optimizations are off (both runs alike). The runs take turns: beside the one-process run
on two cores, the job's processes wait for each other in every collective.
"""

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import launch_local  # noqa: E402  (needs examples/ on the path)
from lm import report  # noqa: E402

RTOL = 1e-5
RTOL_TRAINED = 1e-3
RECIPES = ("fp8_current",)
# train_lm.py on the tiny preset cut to one decoder layer: most of the compile time is the
# layers' (under a scan every layer would cost as much as the first).
ONE_LAYER_TRAIN_LM = """
import dataclasses, sys
sys.path.insert(0, {examples!r})
from lm import presets
tiny = presets.PRESETS["tiny"]
presets.PRESETS["tiny"] = dataclasses.replace(
  tiny, model=dataclasses.replace(tiny.model, n_layers=1)
)
import train_lm
train_lm.main()
""".format(examples=str(ROOT / "examples"))
COMMAND = [
  sys.executable,
  "-c",
  ONE_LAYER_TRAIN_LM,
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
  _, results = report.read_curves_json(out / report.CURVES_JSON)
  return {r.recipe: (r.train_losses, r.val_losses) for r in results}


def test_two_processes_train_as_one_process_on_the_same_mesh(tmp_path):
  one, two = tmp_path / "one_process", tmp_path / "two_processes"
  # The launcher replaces the device count the XLA_FLAGS of this test session give.
  single = _start([*COMMAND, "--out", str(one)], "--xla_force_host_platform_device_count=8")
  single_output = _finish(single)
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
  job_output = _finish(job)

  assert "on mesh data=1,fsdp=4,tensor=2 of 8 x cpu in 2 processes" in job_output
  assert "on mesh data=1,fsdp=4,tensor=2 of 8 x cpu," in single_output
  # Process 0 reports; process 1 ran the same steps silently.
  assert "[0] fp8_current: final validation loss" in job_output
  assert "[1] fp8_current" not in job_output and "[1] model:" not in job_output

  expected, got = _losses(one), _losses(two)
  assert sorted(got) == sorted(expected) == sorted(RECIPES)
  for name in RECIPES:
    (expected_train, expected_val), (train, val) = expected[name], got[name]
    assert len(train) == len(expected_train) == 2 and len(val) == len(expected_val) == 2
    np.testing.assert_allclose(train[0], expected_train[0], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(val[0], expected_val[0], rtol=RTOL, err_msg=name)
    np.testing.assert_allclose(train[1:], expected_train[1:], rtol=RTOL_TRAINED, err_msg=name)
    np.testing.assert_allclose(val[1:], expected_val[1:], rtol=RTOL_TRAINED, err_msg=name)


# Process 1 fails at once; process 0 would wait a minute (in a collective, say).
_ONE_FAILS = (
  "import sys, time\n"
  "process_id = sys.argv[sys.argv.index('--process-id') + 1]\n"
  "print('process', process_id, 'of', sys.argv[sys.argv.index('--num-processes') + 1])\n"
  "sys.exit(3) if process_id == '1' else time.sleep(60)\n"
)


def test_launcher_prefixes_output_and_stops_the_job_when_one_process_fails(capsys):
  start = time.perf_counter()
  status = launch_local.main(
    ["--processes", "2", "--cpu-devices-per-process", "1", "--", sys.executable, "-c", _ONE_FAILS]
  )
  assert status == 3
  assert time.perf_counter() - start < 30  # process 0 was stopped, not waited for
  lines = capsys.readouterr().out.splitlines()
  assert "[0] process 0 of 2" in lines and "[1] process 1 of 2" in lines


def test_launcher_gives_each_process_its_devices():
  assert launch_local.cpu_xla_flags("--a=1 --xla_force_host_platform_device_count=8", 4) == (
    "--a=1 --xla_force_host_platform_device_count=4"
  )
  environments = launch_local.process_environments(2, 4)
  assert [e["JAX_PLATFORMS"] for e in environments] == ["cpu", "cpu"]
  assert all(e["XLA_FLAGS"].endswith("_device_count=4") for e in environments)


def test_launcher_shares_out_the_visible_gpus(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  environments = launch_local.process_environments(2, None)
  assert [e["CUDA_VISIBLE_DEVICES"] for e in environments] == ["0,1", "2,3"]
  with pytest.raises(SystemExit, match="4 GPUs do not split over 3 processes"):
    launch_local.process_environments(3, None)

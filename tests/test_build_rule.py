"""The install's CUDA rule (build_backend/cuda_build_rule.py): the library is compiled only
where a GPU it runs on is visible and a compiler is found, or when JAXQUANT_BUILD_CUDA=1
asks; elsewhere the install skips it and says in one line how to build it."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from jaxquant.kernels import _library as library

_PATH = pathlib.Path(__file__).resolve().parents[1] / "build_backend" / "cuda_build_rule.py"
_spec = importlib.util.spec_from_file_location("cuda_build_rule", _PATH)
rule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rule)

NVCC = "/usr/local/cuda/bin/nvcc"


def test_a_machine_without_a_gpu_skips_the_build_even_with_nvcc():
  decision = rule.decide("AUTO", None, "no CUDA driver (libcuda.so.1) here", NVCC)
  assert not decision.build
  assert "no CUDA driver (libcuda.so.1) here" in decision.reason
  assert "JAXQUANT_BUILD_CUDA=1 pip install ." in decision.reason
  assert "\n" not in decision.reason


def test_a_gpu_the_kernels_do_not_run_on_skips_the_build():
  decision = rule.decide("auto", ["8.0", "8.0"], "", NVCC)
  assert not decision.build and "compute capability 8.0" in decision.reason


def test_a_hopper_gpu_without_a_compiler_skips_the_build_and_says_so():
  decision = rule.decide("AUTO", ["9.0"], "", None)
  assert not decision.build and "no CUDA compiler" in decision.reason


def test_a_hopper_gpu_with_a_compiler_builds():
  assert rule.decide("AUTO", ["8.0", "9.0"], "", NVCC).build


@pytest.mark.parametrize("mode", ["1", "ON", "true"])
def test_asking_builds_anywhere(mode):
  assert rule.decide(mode, None, "no GPU", None).build


@pytest.mark.parametrize("mode", ["0", "OFF", "no"])
def test_refusing_never_builds(mode):
  assert not rule.decide(mode, ["9.0"], "", NVCC).build


def test_an_unknown_mode_is_an_error_naming_it():
  with pytest.raises(ValueError, match="JAXQUANT_BUILD_CUDA='maybe': must be AUTO"):
    rule.decide("maybe", None, "", None)


def test_the_environment_decides_without_probing_when_told(monkeypatch):
  monkeypatch.setattr(rule, "visible_compute_capabilities", lambda: pytest.fail("probed"))
  assert not rule.decide_here({"JAXQUANT_BUILD_CUDA": "0"}).build
  assert rule.decide_here({"JAXQUANT_BUILD_CUDA": "1"}).build


def test_an_unset_or_empty_mode_is_auto(monkeypatch):
  monkeypatch.setattr(rule, "visible_compute_capabilities", lambda: (None, "no GPU (stand-in)"))
  for env in ({"PATH": ""}, {"JAXQUANT_BUILD_CUDA": "", "CUDACXX": NVCC}):
    decision = rule.decide_here(env)
    assert not decision.build and "no GPU (stand-in)" in decision.reason


def test_the_build_and_the_package_agree_on_the_gpus():
  assert rule.SUPPORTED_COMPUTE_CAPABILITIES == library.SUPPORTED_COMPUTE_CAPABILITIES

"""The PEP 517 build backend: scikit-build-core, asking for the CUDA build's own
requirements (the CUTLASS headers, cuBLASLt) only when the CUDA library will be built.

Listed statically in pyproject.toml they were downloaded by every source install, the
444 MB nvidia-cublas wheel included, on machines that build no CUDA code. The rule below
mirrors ffi/CMakeLists.txt's JAXQUANT_BUILD_CUDA: OFF builds nothing, ON always builds,
AUTO builds when a CUDA compiler is found where CMake's check_language(CUDA) looks for one
(the CUDACXX variable, else nvcc on the PATH; a toolkit off the PATH is not found by either).
Should CMake find a compiler this misses, it stops with an error naming the missing wheel
rather than building without it.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403  (the hooks this backend does not change)

CUDA_BUILD_REQUIRES = ["nvidia-cutlass>=4.2,<5", "nvidia-cublas>=13,<14"]
_OFF = ("0", "OFF", "FALSE", "NO")


def _cuda_compiler_found() -> bool:
  return bool(os.environ.get("CUDACXX") or shutil.which("nvcc"))


def builds_cuda() -> bool:
  """Whether this build compiles the CUDA library (JAXQUANT_BUILD_CUDA, default AUTO)."""
  mode = os.environ.get("JAXQUANT_BUILD_CUDA", "AUTO").strip().upper()
  if mode in _OFF:
    return False
  return mode != "AUTO" or _cuda_compiler_found()


def _with_cuda_requires(requires: list[str]) -> list[str]:
  return requires + (CUDA_BUILD_REQUIRES if builds_cuda() else [])


def get_requires_for_build_wheel(config_settings=None):
  return _with_cuda_requires(_scikit_build.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
  return _with_cuda_requires(_scikit_build.get_requires_for_build_editable(config_settings))

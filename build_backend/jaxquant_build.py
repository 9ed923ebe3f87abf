"""The PEP 517 build backend: scikit-build-core, told whether to compile the CUDA library
(cuda_build_rule.py: only where a supported GPU is visible, or when JAXQUANT_BUILD_CUDA=1
asks) and asking for that build's own requirements (JAX's FFI headers, the CUTLASS headers,
cuBLASLt) only then.

Listed statically in pyproject.toml they were downloaded by every source install, the
444 MB nvidia-cublas wheel included, on machines that build no CUDA code; and a CUDA
compiler on the PATH of a machine without a GPU compiled the library for 11 minutes, for
nothing that could run there.
"""

from __future__ import annotations

import sys

import cuda_build_rule
from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403  (the hooks this backend does not change)

CUDA_BUILD_REQUIRES = ["jax>=0.10,<0.13", "nvidia-cutlass>=4.2,<5", "nvidia-cublas>=13,<14"]
# The CMake cache variable ffi/CMakeLists.txt reads (ON builds, OFF builds nothing).
_CMAKE_DEFINE = "cmake.define.JAXQUANT_BUILD_CUDA"


def _with_cuda_requires(requires: list[str]) -> list[str]:
  build = cuda_build_rule.decide_here().build
  return requires + (CUDA_BUILD_REQUIRES if build else [])


def _deciding_cuda(config_settings):
  """The config settings with CMake told the decision, which is printed in one line."""
  decision = cuda_build_rule.decide_here()
  print(decision.reason, file=sys.stderr, flush=True)
  return {**(config_settings or {}), _CMAKE_DEFINE: "ON" if decision.build else "OFF"}


def get_requires_for_build_wheel(config_settings=None):
  return _with_cuda_requires(_scikit_build.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
  return _with_cuda_requires(_scikit_build.get_requires_for_build_editable(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
  return _scikit_build.build_wheel(
    wheel_directory, _deciding_cuda(config_settings), metadata_directory
  )


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
  return _scikit_build.build_editable(
    wheel_directory, _deciding_cuda(config_settings), metadata_directory
  )

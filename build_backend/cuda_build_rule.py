"""Whether `pip install` compiles the CUDA library: only where it can run, or when asked.

JAXQUANT_BUILD_CUDA (read by the build backend, jaxquant_build.py):
- AUTO (the default): build when this machine shows a CUDA GPU of a compute capability the
  library's code runs on and a CUDA compiler is found (CUDACXX, else nvcc on the PATH);
  elsewhere install the pure-JAX package alone, which takes seconds instead of the minutes
  the CUDA build takes, and say in one line how to build the kernels.
- 1 / ON: always build (a machine that builds for GPUs it does not have); CMake stops with
  an error where it finds no CUDA compiler.
- 0 / OFF: never build.

Free of scikit-build-core, so that the tests can check the rule without a build
environment.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from typing import Mapping, NamedTuple, Optional, Sequence

MODE_VAR = "JAXQUANT_BUILD_CUDA"
ON_VALUES = ("1", "ON", "TRUE", "YES")
OFF_VALUES = ("0", "OFF", "FALSE", "NO")
AUTO_VALUE = "AUTO"
# The library holds sm_90a code only (ffi/CMakeLists.txt's JAXQUANT_CUDA_GENCODE); the
# package checks the GPUs it runs on against the same list
# (jaxquant/kernels/_library.py; tests/test_build_rule.py keeps the two equal).
SUPPORTED_COMPUTE_CAPABILITIES = ("9.0",)
HOW_TO_BUILD = (
  f"to build them (Hopper, sm_90a; needs nvcc): {MODE_VAR}=1 pip install . "
  "(docs/gpu.md, 'The build')"
)

# CUDA driver API: attributes of cuDeviceGetAttribute.
_COMPUTE_CAPABILITY_MAJOR = 75
_COMPUTE_CAPABILITY_MINOR = 76


class Decision(NamedTuple):
  build: bool
  reason: str  # one line for the build log


def visible_compute_capabilities() -> tuple[Optional[list[str]], str]:
  """The compute capabilities ("9.0") of the GPUs the CUDA driver shows this process
  (CUDA_VISIBLE_DEVICES applies), or (None, why none can be asked for)."""
  try:
    driver = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None, "no CUDA driver (libcuda.so.1) here"
  status = driver.cuInit(0)
  if status != 0:
    return None, f"the CUDA driver sees no GPU (cuInit returned {status})"
  count = ctypes.c_int()
  if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
    return None, "the CUDA driver could not count the GPUs"
  capabilities = []
  for ordinal in range(count.value):
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (
      driver.cuDeviceGet(ctypes.byref(device), ordinal)
      or driver.cuDeviceGetAttribute(ctypes.byref(major), _COMPUTE_CAPABILITY_MAJOR, device)
      or driver.cuDeviceGetAttribute(ctypes.byref(minor), _COMPUTE_CAPABILITY_MINOR, device)
    ):
      return None, f"the CUDA driver could not describe GPU {ordinal}"
    capabilities.append(f"{major.value}.{minor.value}")
  return capabilities, "" if capabilities else "the CUDA driver sees no GPU"


def cuda_compiler(env: Mapping[str, str]) -> Optional[str]:
  """The CUDA compiler CMake's check_language(CUDA) would find: CUDACXX, else nvcc on the
  PATH (a toolkit off the PATH is found by neither)."""
  return env.get("CUDACXX") or shutil.which("nvcc", path=env.get("PATH"))


def decide(
  mode: str,
  capabilities: Optional[Sequence[str]],
  no_gpu_reason: str,
  compiler: Optional[str],
) -> Decision:
  """The rule above, given JAXQUANT_BUILD_CUDA's value, the visible GPUs' compute
  capabilities (None: none could be asked for, `no_gpu_reason` says why) and the CUDA
  compiler found (None: none)."""
  value = mode.strip().upper()
  if value in OFF_VALUES:
    return Decision(False, f"jaxquant: {MODE_VAR}={mode}: not building the CUDA kernels")
  if value in ON_VALUES:
    return Decision(True, f"jaxquant: {MODE_VAR}={mode}: building the CUDA kernels")
  if value != AUTO_VALUE:
    raise ValueError(
      f"{MODE_VAR}={mode!r}: must be AUTO (the default), one of {ON_VALUES} or one of {OFF_VALUES}"
    )
  supported = [c for c in capabilities or () if c in SUPPORTED_COMPUTE_CAPABILITIES]
  if not supported:
    if capabilities:
      why = (
        f"this machine's GPUs have compute capability {', '.join(sorted(set(capabilities)))}, "
        f"the kernels run on {', '.join(SUPPORTED_COMPUTE_CAPABILITIES)} only"
      )
    else:
      why = no_gpu_reason or "no CUDA GPU visible"
    return Decision(
      False,
      f"jaxquant: CUDA kernels not built ({why}); the ops run the pure-JAX reference; "
      + HOW_TO_BUILD,
    )
  if compiler is None:
    return Decision(
      False,
      "jaxquant: CUDA kernels not built (a supported GPU is visible but no CUDA compiler: "
      "neither CUDACXX nor nvcc on the PATH); " + HOW_TO_BUILD,
    )
  return Decision(
    True, f"jaxquant: building the CUDA kernels with {compiler} (a supported GPU is visible)"
  )


def decide_here(env: Mapping[str, str] = os.environ) -> Decision:
  """The rule applied to this machine and environment."""
  mode = env.get(MODE_VAR) or AUTO_VALUE
  if mode.strip().upper() != AUTO_VALUE:
    return decide(mode, None, "", None)
  capabilities, no_gpu_reason = visible_compute_capabilities()
  return decide(mode, capabilities, no_gpu_reason, cuda_compiler(env))

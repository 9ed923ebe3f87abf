"""Loads the CUDA FFI library built next to this file and registers its targets.

Registration happens once, when `jaxquant.kernels` is imported; it needs no GPU (XLA
keeps targets for a platform until that platform's backend starts). Whether the kernels
can actually run is `unavailable_reason()`: None, or a sentence saying what is missing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
from typing import Optional

import jax
from jaxlib import xla_client

LIBRARY_NAME = "libjaxquant_ffi.so"
# FFI target name -> exported handler symbol (ffi/include/jaxquant/handlers.h).
TARGETS = {
  "jaxquant_amax": "JaxquantAmax",
  "jaxquant_fp8_tensor_cast": "JaxquantFp8TensorCast",
  "jaxquant_fp8_block_cast": "JaxquantFp8BlockCast",
  "jaxquant_mxfp8_cast": "JaxquantMxfp8Cast",
  "jaxquant_mxfp8_values": "JaxquantMxfp8Values",
  "jaxquant_nvfp4_cast": "JaxquantNvfp4Cast",
  "jaxquant_nvfp4_values": "JaxquantNvfp4Values",
  "jaxquant_nvfp4_decode_scale": "JaxquantNvfp4DecodeScale",
  "jaxquant_delayed_scale": "JaxquantDelayedScale",
  "jaxquant_dequantize": "JaxquantDequantize",
  "jaxquant_grouped_gemm": "JaxquantGroupedGemm",
  "jaxquant_block_fp8_gemm": "JaxquantBlockFp8Gemm",
  "jaxquant_dequant_gemm": "JaxquantDequantGemm",
  "jaxquant_fp8_tensor_gemm": "JaxquantFp8TensorGemm",
  "jaxquant_scaled_bf16_gemm": "JaxquantScaledBf16Gemm",
}
# Plain C functions that size a target's workspace, the result buffer its lowering adds
# (primitive.KernelSpec.workspace_bytes; handlers.h): target -> (symbol, argument types).
WORKSPACE_QUERIES = {
  "jaxquant_grouped_gemm": ("JaxquantGroupedGemmWorkspaceBytes", (ctypes.c_int32,)),
  "jaxquant_dequant_gemm": (
    "JaxquantDequantGemmWorkspaceBytes",
    (ctypes.c_int64,) * 3 + (ctypes.c_int32,) * 2,
  ),
  "jaxquant_block_fp8_gemm": (
    "JaxquantBlockFp8GemmWorkspaceBytes",
    (ctypes.c_int64,) * 3 + (ctypes.c_int32,) * 2,
  ),
}
# The library holds sm_90a code only.
SUPPORTED_COMPUTE_CAPABILITIES = ("9.0",)


def library_path() -> pathlib.Path:
  """The installed library, or JAXQUANT_FFI_LIBRARY (a build tree's copy) when set."""
  override = os.environ.get("JAXQUANT_FFI_LIBRARY")
  return pathlib.Path(override) if override else pathlib.Path(__file__).with_name(LIBRARY_NAME)


@functools.cache
def _load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
  """(the library, None) once it is loaded and its targets registered; (None, why not)."""
  path = library_path()
  if not path.exists():
    return None, (
      f"the CUDA library is not installed ({path} is missing): jaxquant was built "
      "without a CUDA compiler or with JAXQUANT_BUILD_CUDA=0; reinstall with nvcc "
      "on the PATH"
    )
  try:
    lib = ctypes.CDLL(str(path))
  except OSError as e:
    return None, f"could not load {path}: {e}"
  queries = [symbol for symbol, _ in WORKSPACE_QUERIES.values()]
  missing = [s for s in (*TARGETS.values(), *queries) if not hasattr(lib, s)]
  if missing:
    return None, f"{path} lacks {', '.join(missing)}: it was built from other sources"
  for symbol, argtypes in WORKSPACE_QUERIES.values():
    query = getattr(lib, symbol)
    query.argtypes, query.restype = list(argtypes), ctypes.c_int64
  for target, symbol in TARGETS.items():
    # Every target may be traced into XLA's command buffers (CUDA graphs) along with the
    # fusions around it: the same kernels for the same attributes and shapes, no host
    # synchronization while captured, and no scratch memory (XLA's scratch allocator frees
    # its memory when the call returns, a captured graph would keep the address): the GEMMs
    # that need workspace take it as one more result buffer, which XLA allocates with the
    # call (WORKSPACE_QUERIES). The handlers report the same trait in their FFI metadata
    # (ffi_glue.h, JAXQUANT_CMD_BUFFER_SAFE); tests/kernels/test_command_buffers.py checks
    # on the GPU that their kernels run from XLA's CUDA graphs.
    jax.ffi.register_ffi_target(
      target,
      jax.ffi.pycapsule(getattr(lib, symbol)),
      platform="CUDA",
      traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE,
    )
  return lib, None


def load_error() -> Optional[str]:
  """Loads and registers the library once; returns why that failed, or None."""
  return _load()[1]


def workspace_bytes(target: str, *dims: int) -> int:
  """Bytes of workspace `target`'s handler needs for a problem of these dims on this
  machine's GPU (the grouped GEMM's per-group arrays and TMA descriptors, the fused-dequantize
  GEMM's split-K partial sums, the block FP8 GEMM's reordered tile scales and cuBLASLt's or
  CUTLASS's workspace): the size of the result buffer its lowering adds."""
  lib, error = _load()
  if error:
    raise RuntimeError(f"{target}: {error}")
  size = getattr(lib, WORKSPACE_QUERIES[target][0])(*dims)
  if size < 0:
    raise RuntimeError(
      f"{target}: could not size the workspace for dims {dims}: the CUDA "
      "device could not be queried"
    )
  return size


@functools.cache
def unavailable_reason() -> Optional[str]:
  """None when the kernels can run here; otherwise why not."""
  error = load_error()
  if error:
    return error
  try:
    gpus = jax.devices("cuda")
  except RuntimeError:
    return f"JAX has no CUDA backend (backends: {jax.default_backend()})"
  capabilities = {getattr(d, "compute_capability", "?") for d in gpus}
  if not capabilities <= set(SUPPORTED_COMPUTE_CAPABILITIES):
    return (
      f"the kernels are built for compute capability 9.0 (Hopper) only; this machine's "
      f"GPUs report {sorted(capabilities)}"
    )
  return None


def available() -> bool:
  return unavailable_reason() is None

"""Loads the CUDA FFI library built next to this file and registers its targets.

The kernel specs name the targets (kernels/_targets.py collects them); each one's handler
is the library's export of the same name in CamelCase (`handler_symbol`, handlers.h).
Nothing is loaded on import: the library is opened, once, when a GPU platform asks for the
kernels (`kernels.available()` finding a supported GPU, or a lowering for CUDA), so that
a CPU machine, or one whose library cannot load, never runs its code.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
from typing import Optional

import jax
from jaxlib import xla_client

# The kernels' own build rule (build_backend/cuda_build_rule.py) says how they get built.
HOW_TO_BUILD = "JAXQUANT_BUILD_CUDA=1 pip install . (on a machine with nvcc; docs/gpu.md)"
LIBRARY_OVERRIDE_VAR = "JAXQUANT_FFI_LIBRARY"
_log = logging.getLogger(__name__)

LIBRARY_NAME = "libjaxquant_ffi.so"
# The argument types of the plain C functions that size a target's workspace, the result
# buffer its lowering adds (primitive.KernelSpec.workspace_bytes; handlers.h), each the
# target's handler symbol followed by WorkspaceBytes.
WORKSPACE_QUERIES = {
  "jaxquant_grouped_gemm": (ctypes.c_int32,),
  "jaxquant_grouped_wgrad": (ctypes.c_int32,),
  "jaxquant_dequant_gemm": (ctypes.c_int64,) * 3 + (ctypes.c_int32,) * 2,
  "jaxquant_block_fp8_gemm": (ctypes.c_int64,) * 3 + (ctypes.c_int32,) * 2,
  "jaxquant_fp8_tensor_gemm": (ctypes.c_int64,) * 2,
  "jaxquant_scaled_bf16_gemm": (ctypes.c_int64,) * 2,
}
# The library holds sm_90a code only (the install builds it only where such a GPU is
# visible: build_backend/cuda_build_rule.py, whose list tests/test_build_rule.py keeps equal).
SUPPORTED_COMPUTE_CAPABILITIES = ("9.0",)


def handler_symbol(target: str) -> str:
  """The exported handler of an FFI target: jaxquant_fp8_tensor_cast -> JaxquantFp8TensorCast."""
  return "".join(part.capitalize() for part in target.split("_"))


def _workspace_query_symbol(target: str) -> str:
  return handler_symbol(target) + "WorkspaceBytes"


def library_path() -> pathlib.Path:
  """The installed library, or JAXQUANT_FFI_LIBRARY (a build tree's copy) when set."""
  override = os.environ.get(LIBRARY_OVERRIDE_VAR)
  return pathlib.Path(override) if override else pathlib.Path(__file__).with_name(LIBRARY_NAME)


@functools.cache
def _load() -> tuple[Optional[ctypes.CDLL], Optional[str]]:
  """(the library, None) once it is loaded; (None, why not)."""
  path = library_path()
  if os.environ.get(LIBRARY_OVERRIDE_VAR):
    # Loading runs the library's constructors: whoever set the variable should see it.
    _log.warning("jaxquant: loading the CUDA library %s named by %s", path, LIBRARY_OVERRIDE_VAR)
  if not path.exists():
    if os.environ.get(LIBRARY_OVERRIDE_VAR):
      return None, f"{LIBRARY_OVERRIDE_VAR}={path}: no such file"
    return None, (
      f"the CUDA library was not built ({path} is missing): `pip install` builds it only "
      f"where a Hopper GPU is visible or asked to; to build it: {HOW_TO_BUILD}"
    )
  try:
    lib = ctypes.CDLL(str(path))
  except OSError as e:
    return None, (
      f"the CUDA library {path} is built but could not be loaded, a library it needs is "
      f"missing or unreadable ({e}): it takes cuBLASLt from the nvidia-cublas wheel (CUDA 13) "
      "that JAX's CUDA plugin installs (pip install 'jax[cuda13]')"
    )
  missing = [s for s in map(_workspace_query_symbol, WORKSPACE_QUERIES) if not hasattr(lib, s)]
  if missing:
    return None, f"{path} lacks {', '.join(missing)}: it was built from other sources"
  for target, argtypes in WORKSPACE_QUERIES.items():
    query = getattr(lib, _workspace_query_symbol(target))
    query.argtypes, query.restype = list(argtypes), ctypes.c_int64
  return lib, None


def register(targets: tuple[str, ...]) -> Optional[str]:
  """Loads the library and registers the FFI targets with their handlers (each once);
  returns why it could not (no library, or one without some target's handler: then none is
  registered), or None."""
  lib, error = _load()
  if error:
    return error
  missing = [handler_symbol(t) for t in targets if not hasattr(lib, handler_symbol(t))]
  if missing:
    return f"{library_path()} lacks {', '.join(missing)}: it was built from other sources"
  for target in targets:
    _register_target(lib, target)
  return None


@functools.cache
def _register_target(lib: ctypes.CDLL, target: str) -> None:
  # Every target may be traced into XLA's command buffers (CUDA graphs) along with the
  # fusions around it: the same kernels for the same attributes and shapes, no host
  # synchronization while captured, and no scratch memory (XLA's scratch allocator frees
  # its memory when the call returns, a captured graph would keep the address): the GEMMs
  # that need workspace take it as one more result buffer, which XLA allocates with the
  # call (WORKSPACE_QUERIES). The handlers report the same trait in their FFI metadata
  # (bindings.h, JAXQUANT_DEFINE_HANDLER); tests/kernels/test_command_buffers.py checks
  # on the GPU that their kernels run from XLA's CUDA graphs.
  jax.ffi.register_ffi_target(
    target,
    jax.ffi.pycapsule(getattr(lib, handler_symbol(target))),
    platform="CUDA",
    traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE,
  )


def workspace_bytes(target: str, *dims: int) -> int:
  """Bytes of workspace `target`'s handler needs for a problem of these dims on this
  machine's GPU (the grouped GEMM's per-group arrays and TMA descriptors, the fused-dequantize
  GEMM's split-K partial sums, the block FP8 GEMM's reordered tile scales and cuBLASLt's or
  CUTLASS's workspace, the per-tensor FP8 and scaled bf16 GEMMs' cuBLASLt workspace): the
  size of the result buffer its lowering adds."""
  lib, error = _load()
  if error:
    raise RuntimeError(f"{target}: {error}")
  size = getattr(lib, _workspace_query_symbol(target))(*dims)
  if size < 0:
    raise RuntimeError(
      f"{target}: could not size the workspace for dims {dims}: the CUDA "
      "device could not be queried"
    )
  return size


def device_reason() -> Optional[str]:
  """None when this machine has GPUs the library's code runs on; otherwise why not."""
  try:
    gpus = jax.devices("cuda")
  except RuntimeError:
    return (
      f"no CUDA GPU in use (JAX's backend here is {jax.default_backend()}): the kernels run "
      "on Hopper GPUs through JAX's CUDA plugin (jax[cuda13]); the ops run the pure-JAX "
      "reference"
    )
  capabilities = {getattr(d, "compute_capability", "?") for d in gpus}
  if not capabilities <= set(SUPPORTED_COMPUTE_CAPABILITIES):
    return (
      f"the kernels are built for compute capability 9.0 (Hopper) only; this machine's "
      f"GPUs report {sorted(capabilities)}"
    )
  return None

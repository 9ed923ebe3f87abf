"""Every kernel's FFI targets, registered with the library, and whether the kernels can run.

The kernel specs are the one list of FFI targets: each names its own (`KernelSpec.targets`),
and the library exports the handler of each (ffi/include/jaxquant/handlers.h;
tests/kernels/test_ffi_bindings.py checks the two against each other, and that SPECS holds
every spec of the package).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from jaxquant.kernels import (
  _amax,
  _bf16_gemm,
  _block_gemm,
  _cast,
  _decode_scale,
  _delayed_scale,
  _dequantize,
  _fused_dequant,
  _gemm_values,
  _grouped,
  _tensor_gemm,
)
from jaxquant.kernels import _library as library

_log = logging.getLogger(__name__)

SPECS = (
  _amax.SPEC,
  _cast.SPEC,
  _gemm_values.MXFP8_VALUES_SPEC,
  _gemm_values.NVFP4_VALUES_SPEC,
  _decode_scale.SPEC,
  _delayed_scale.SPEC,
  _dequantize.SPEC,
  _grouped.SPEC,
  _grouped.WGRAD_SPEC,
  _block_gemm.SPEC,
  _fused_dequant.SPEC,
  _tensor_gemm.SPEC,
  _bf16_gemm.SPEC,
)
TARGETS = tuple(target for spec in SPECS for target in spec.targets)


@functools.cache
def unavailable_reason() -> Optional[str]:
  """None when the kernels can run here; otherwise why not: no GPU in use, a GPU they do
  not run on, the library not built, or built but not loadable. The library is loaded (and
  every target registered) only once a supported GPU is found."""
  device_error = library.device_reason()
  if device_error:
    return device_error
  error = library.register(TARGETS)
  if error:
    # A GPU machine silently running the reference would look slow for no visible reason.
    _log.warning("jaxquant: the CUDA kernels cannot run on this GPU: %s", error)
  return error


def available() -> bool:
  return unavailable_reason() is None

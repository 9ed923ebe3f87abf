"""JAX primitives over jaxquant's CUDA FFI kernels.

Each primitive lowers to its CUDA kernel on GPUs and to the pure-JAX reference elsewhere,
batches under `vmap` and partitions under sharded `jit` (Shardy). Importing this package
loads nothing: the CUDA library is loaded, and the kernels' FFI targets registered, once a
GPU platform asks for them (`available()` on a supported GPU, or a lowering for CUDA).

`available()` says whether the kernels can run here, `unavailable_reason()` why not.
"""

from jaxquant.kernels._amax import amax
from jaxquant.kernels._bf16_gemm import scaled_bf16_gemm
from jaxquant.kernels._block_gemm import block_fp8_gemm
from jaxquant.kernels._config import CastConfig, unsupported_reason
from jaxquant.kernels._decode_scale import decode_scale
from jaxquant.kernels._delayed_scale import delayed_scale
from jaxquant.kernels._dequantize import dequantize_data
from jaxquant.kernels._fused_dequant import dequant_gemm
from jaxquant.kernels._grouped import grouped_gemm, grouped_wgrad
from jaxquant.kernels._library import library_path
from jaxquant.kernels._quantize import (
  cast,
  cast_amaxes,
  quantize_usages,
  quantize_usages_and_amax,
)
from jaxquant.kernels._targets import available, unavailable_reason
from jaxquant.kernels._tensor_gemm import fp8_tensor_gemm

__all__ = [
  "available",
  "unavailable_reason",
  "library_path",
  "cast",
  "cast_amaxes",
  "amax",
  "quantize_usages",
  "quantize_usages_and_amax",
  "decode_scale",
  "delayed_scale",
  "dequantize_data",
  "grouped_gemm",
  "grouped_wgrad",
  "block_fp8_gemm",
  "dequant_gemm",
  "fp8_tensor_gemm",
  "scaled_bf16_gemm",
  "CastConfig",
  "unsupported_reason",
]

// The FFI handler symbols this library exports, one per target. The library is built with
// hidden visibility; declaring the handlers here first makes exactly these visible.
// The Python kernel specs name the targets, and Python registers each target
// "jaxquant_<snake_case>" with the handler of that name in CamelCase, Jaxquant<CamelCase>
// (kernels/_library.py); tests/kernels/test_ffi_bindings.py checks that this list holds
// exactly the handlers of the specs' targets. The handlers are defined with
// JAXQUANT_DEFINE_HANDLER (bindings.h).
#pragma once

#include <cstdint>

#include "xla/ffi/api/c_api.h"

#define JAXQUANT_HANDLER(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*)

JAXQUANT_HANDLER(JaxquantAmax);
JAXQUANT_HANDLER(JaxquantFp8TensorCast);
JAXQUANT_HANDLER(JaxquantFp8BlockCast);
JAXQUANT_HANDLER(JaxquantMxfp8Cast);
JAXQUANT_HANDLER(JaxquantMxfp8Values);
JAXQUANT_HANDLER(JaxquantNvfp4Cast);
JAXQUANT_HANDLER(JaxquantNvfp4Values);
JAXQUANT_HANDLER(JaxquantNvfp4DecodeScale);
JAXQUANT_HANDLER(JaxquantDelayedScale);
JAXQUANT_HANDLER(JaxquantDequantize);
JAXQUANT_HANDLER(JaxquantGroupedGemm);
JAXQUANT_HANDLER(JaxquantGroupedWgrad);
JAXQUANT_HANDLER(JaxquantBlockFp8Gemm);
JAXQUANT_HANDLER(JaxquantDequantGemm);
JAXQUANT_HANDLER(JaxquantFp8TensorGemm);
JAXQUANT_HANDLER(JaxquantScaledBf16Gemm);

#undef JAXQUANT_HANDLER

// Bytes of the workspace result the grouped GEMM needs for this many groups on the current
// device (Python sizes the buffer with it when lowering; kernels/_grouped.py); -1 when the
// device cannot be queried.
extern "C" __attribute__((visibility("default"))) int64_t
JaxquantGroupedGemmWorkspaceBytes(int32_t num_groups);
// The same for the wgrad grouping of the grouped GEMM (the same kernels).
extern "C" __attribute__((visibility("default"))) int64_t
JaxquantGroupedWgradWorkspaceBytes(int32_t num_groups);

// Bytes of the workspace result the fused-dequantize GEMM needs for A [M, K] x B [N, K] with
// these element codes on the current device (kernels/_fused_dequant.py); -1 when the device
// cannot be queried or an element code is unknown.
extern "C" __attribute__((visibility("default"))) int64_t JaxquantDequantGemmWorkspaceBytes(
    int64_t m, int64_t n, int64_t k, int32_t a_element, int32_t b_element);

// Bytes of the workspace result the block FP8 GEMM needs for A [M, K] x B [N, K] with B in
// 1x128 or 128x128 blocks and a bf16 (f32_out = 0) or fp32 output, on the current device
// (kernels/_block_gemm.py); -1 when the device cannot be queried or the blocks are neither.
extern "C" __attribute__((visibility("default"))) int64_t JaxquantBlockFp8GemmWorkspaceBytes(
    int64_t m, int64_t n, int64_t k, int32_t b_block_rows, int32_t f32_out);

// Bytes of the workspace result the per-tensor FP8 GEMM and the scaled bf16 GEMM need for a
// D [M, N] (kernels/_tensor_gemm.py, kernels/_bf16_gemm.py): cuBLASLt's whole workspace,
// none for an empty D.
extern "C" __attribute__((visibility("default"))) int64_t
JaxquantFp8TensorGemmWorkspaceBytes(int64_t m, int64_t n);
extern "C" __attribute__((visibility("default"))) int64_t
JaxquantScaledBf16GemmWorkspaceBytes(int64_t m, int64_t n);

// GEMMs through cuBLASLt, shared by the per-tensor FP8 handler (fp8_tensor_gemm.cu), the
// block FP8 handler (block_fp8_gemm.cu) and the scaled bf16 handler (scaled_bf16_gemm.cu):
// D [m, n] = A [m, k] . B [n, k]^T with A and B in their stored (K-major) layout, FP8 codes
// with each operand's decode scales applied inside the GEMM or bf16 values, optionally
// times a scale from the device, D bf16 or fp32 rounded once from the scaled fp32 sums.
#pragma once

#include <cublasLt.h>

#include <cstdint>

#include "jaxquant/ffi_glue.h"

namespace jaxquant {

// One operand's decode scales, in the layout cuBLASLt's scale mode defines:
// - SCALAR_32F: one float;
// - VEC128_32F: a float per 128-deep k-block of each row, k-block-major ([ceil(k/128), rows],
//   rows padded to a multiple of 4);
// - BLK128x128_32F: a float per 128x128 tile, row-block-major ([ceil(rows/128),
//   ceil(k/128) padded to a multiple of 4]).
struct LtScales {
  cublasLtMatmulMatrixScale_t mode;
  const float* data;
};

// An operand's codes or values; `scales.data` null for bf16 values, which take no scales.
struct LtOperand {
  const void* data;
  cudaDataType_t type;
  LtScales scales;
};

// A workspace of kLtWorkspaceBytes (aligned) lets cuBLASLt consider every algorithm:
// NVIDIA's recommendation for Hopper (split-K algorithms keep partial sums in it).
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

// The workspace result a GEMM that is only a cuBLASLt call takes: kLtWorkspaceBytes from
// its first aligned address on (Workspace::after).
constexpr size_t lt_workspace_result_bytes() { return kWorkspaceAlignment + kLtWorkspaceBytes; }

// The workspace of a GEMM that is only a cuBLASLt call (fp8_tensor_gemm.cu,
// scaled_bf16_gemm.cu): its results after D, none or one of at least
// lt_workspace_result_bytes(). The lowering adds it only where the computation spans more
// than one device (kernels/_primitive.py says why); without it the Workspace is empty.
ffi::ErrorOr<Workspace> lt_workspace_result(const ffi::RemainingRets& rets, const char* what);

// Runs the GEMM on `stream`. Returns false, having run nothing, when cuBLASLt has no
// algorithm for the problem (the caller may take another kernel); an error when a call
// fails. The algorithm is chosen on the problem's first call in the process (timed among
// the heuristic's candidates) and kept with one cuBLASLt handle per device. Candidates use
// at most the workspace given (none with an empty one). The call touches no memory but its
// operands and the workspace: a handler may be traced into XLA's command buffers.
//
// `device_alpha_beta`, when not null, holds two floats on the device, cuBLASLt's alpha and
// beta: alpha multiplies the fp32 sums before the rounding to D's type, and beta must be 0
// (D is not read). cuBLASLt's alpha vector (a scale per row) has no algorithm for bf16 on
// the H100; its device pointer mode wants both scalars in device memory.
//
// `fast_accumulation` is cuBLASLt's FAST_ACCUM for FP8 operands: the tensor cores' partial
// sums are never promoted to the fp32 accumulator along k (faster; the sums keep about 14
// bits per instruction's alignment instead of fp32's 24, docs/numerics.md). Without it
// cuBLASLt promotes them at a fixed k interval.
ffi::ErrorOr<bool> lt_gemm(cudaStream_t stream, int32_t device, const Workspace& workspace,
                           const LtOperand& a, const LtOperand& b, const float* device_alpha_beta,
                           void* d, cudaDataType_t td, int64_t m, int64_t n, int64_t k,
                           bool fast_accumulation);

}  // namespace jaxquant

// Scaled bf16 GEMM through cuBLASLt (lt_gemm.h): D = alpha * (A . B^T), A [M, K] and B [N, K]
// bf16 values in their stored (K-major) layout, alpha on the device (with cuBLASLt's beta,
// 0, after it), D [M, N] bf16 or fp32 rounded once from the scaled fp32 sums.
//
// The GEMM of MXFP8 / NVFP4 operands that dequantize first (ops/gemm.py): their values are
// exact in bf16 and NVFP4's decode scales S_dec multiply the sums. XLA's dot cannot take a
// runtime scale: it writes fp32 sums for a separate pass (or its consumers) to scale and
// round, reading and writing twice the bytes of a bf16 result.
#include <string>

#include "jaxquant/bindings.h"
#include "lt_gemm.h"

namespace jaxquant {
namespace {

ffi::Error scaled_bf16_gemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                            ffi::Buffer<ffi::F32> alpha_beta, ffi::Result<ffi::AnyBuffer> d,
                            ffi::RemainingRets workspace_result) {
  int64_t m, k, n, kb;
  const auto dd = d->dimensions();
  if (!matrix_dims(a, m, k) || !matrix_dims(b, n, kb) || dd.size() != 2 || kb != k || dd[0] != m ||
      dd[1] != n || alpha_beta.element_count() != 2) {
    return invalid("scaled_bf16_gemm: expects A [M, K], B [N, K], alpha and beta [2] and D [M, N]");
  }
  if (a.element_type() != ffi::DataType::BF16 || b.element_type() != ffi::DataType::BF16) {
    return invalid("scaled_bf16_gemm: operands must be bfloat16");
  }
  cudaDataType_t td;
  switch (d->element_type()) {
    case ffi::DataType::BF16:
      td = CUDA_R_16BF;
      break;
    case ffi::DataType::F32:
      td = CUDA_R_32F;
      break;
    default:
      return invalid("scaled_bf16_gemm: the output dtype must be bfloat16 or float32");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  const LtScales none{CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, nullptr};
  const LtOperand lt_a{a.untyped_data(), CUDA_R_16BF, none};
  const LtOperand lt_b{b.untyped_data(), CUDA_R_16BF, none};
  // cuBLASLt's workspace where the call has one, as the per-tensor FP8 GEMM takes it
  // (fp8_tensor_gemm.cu).
  auto given = lt_workspace_result(workspace_result, "scaled_bf16_gemm");
  if (given.has_error()) return given.error();
  auto ran = lt_gemm(stream, device, *given, lt_a, lt_b, alpha_beta.typed_data(), d->untyped_data(),
                     td, m, n, k, /*fast_accumulation=*/false);
  if (ran.has_error()) return ran.error();
  if (!*ran) {
    return ffi::Error::Internal(
        "scaled_bf16_gemm: cuBLASLt has no algorithm for M=" + std::to_string(m) +
        ", N=" + std::to_string(n) + ", K=" + std::to_string(k));
  }
  return ffi::Error::Success();
}

auto scaled_bf16_gemm_binding() {
  return stream_binding()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()         // A
      .Arg<ffi::AnyBuffer>()         // B
      .Arg<ffi::Buffer<ffi::F32>>()  // alpha, beta
      .Ret<ffi::AnyBuffer>()         // D
      .RemainingRets();              // cuBLASLt's workspace, or none
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantScaledBf16Gemm, jaxquant::scaled_bf16_gemm,
                        jaxquant::scaled_bf16_gemm_binding());

int64_t JaxquantScaledBf16GemmWorkspaceBytes(int64_t m, int64_t n) {
  // An empty problem returns before touching its workspace.
  return m <= 0 || n <= 0 ? 0 : static_cast<int64_t>(jaxquant::lt_workspace_result_bytes());
}

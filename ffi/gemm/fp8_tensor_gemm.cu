// Per-tensor FP8 GEMM through cuBLASLt (lt_gemm.h): D = (sa * sb) * (A . B^T), A [M, K]
// and B [N, K] FP8 codes in their stored (K-major) layout, sa and sb their decode scales
// (device scalars), D [M, N] bf16 or fp32 rounded once from the fp32 sums.
//
// Why not XLA's dot on f8 operands: XLA hands cuBLASLt the scales but keeps an fp32
// result and converts it to bf16 in a separate pass (an 8192^2 output: 128 us of a
// 0.95 ms call on the H100, docs/kernels.md). Asking cuBLASLt for the bf16 output directly
// drops that pass; the scaled fp32 sums are rounded once, as in the reference.
//
// Where the computation spans more than one device the call takes cuBLASLt's full
// workspace, as XLA's own GEMMs do, as a result buffer XLA allocates with it (so it stays
// safe to trace into XLA's command buffers). With no workspace cuBLASLt runs the same
// algorithm's statically scheduled kernel (`ssched` in its name): as fast on an idle GPU,
// but its tiles are dealt out to the SMs in advance, so it loses more than the dynamically
// scheduled one while NCCL's kernels hold SMs beside it (an FSDP step's gathers;
// docs/sharding.md). On one device the call has D alone: a second result makes the call
// tuple-shaped, and XLA then lets no fusion write its output in place of D
// (kernels/_primitive.py).
#include <string>

#include "jaxquant/bindings.h"
#include "lt_gemm.h"

namespace jaxquant {
namespace {

bool lt_type(ffi::DataType dtype, cudaDataType_t& out) {
  switch (dtype) {
    case ffi::DataType::F8E4M3FN:
      out = CUDA_R_8F_E4M3;
      return true;
    case ffi::DataType::F8E5M2:
      out = CUDA_R_8F_E5M2;
      return true;
    case ffi::DataType::BF16:
      out = CUDA_R_16BF;
      return true;
    case ffi::DataType::F32:
      out = CUDA_R_32F;
      return true;
    default:
      return false;
  }
}

ffi::Error fp8_tensor_gemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           ffi::Buffer<ffi::F32> sa, ffi::Buffer<ffi::F32> sb,
                           ffi::Result<ffi::AnyBuffer> d, ffi::RemainingRets workspace_result,
                           bool fast_accumulation) {
  int64_t m, k, n, kb;
  const auto dd = d->dimensions();
  if (!matrix_dims(a, m, k) || !matrix_dims(b, n, kb) || dd.size() != 2 || kb != k || dd[0] != m ||
      dd[1] != n || sa.element_count() != 1 || sb.element_count() != 1) {
    return invalid("fp8_tensor_gemm: expects A [M, K], B [N, K], two scalar scales and D [M, N]");
  }
  cudaDataType_t ta, tb, td;
  if (!lt_type(a.element_type(), ta) || !lt_type(b.element_type(), tb) || ta == CUDA_R_16BF ||
      ta == CUDA_R_32F || tb == CUDA_R_16BF || tb == CUDA_R_32F ||
      (ta == CUDA_R_8F_E5M2 && tb == CUDA_R_8F_E5M2)) {
    return invalid("fp8_tensor_gemm: operands must be an FP8 pair other than E5M2 x E5M2");
  }
  if (!lt_type(d->element_type(), td) || (td != CUDA_R_16BF && td != CUDA_R_32F)) {
    return invalid("fp8_tensor_gemm: the output dtype must be bfloat16 or float32");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  const LtOperand lt_a{
      a.untyped_data(), ta, {CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, sa.typed_data()}};
  const LtOperand lt_b{
      b.untyped_data(), tb, {CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, sb.typed_data()}};
  auto given = lt_workspace_result(workspace_result, "fp8_tensor_gemm");
  if (given.has_error()) return given.error();
  auto ran = lt_gemm(stream, device, *given, lt_a, lt_b, /*device_alpha_beta=*/nullptr,
                     d->untyped_data(), td, m, n, k, fast_accumulation);
  if (ran.has_error()) return ran.error();
  if (!*ran) {
    return ffi::Error::Internal(
        "fp8_tensor_gemm: cuBLASLt has no algorithm for M=" + std::to_string(m) +
        ", N=" + std::to_string(n) + ", K=" + std::to_string(k));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantFp8TensorGemm, jaxquant::fp8_tensor_gemm,
                        jaxquant::scaled_gemm_binding()
                            .RemainingRets()  // cuBLASLt's workspace, or none
                            .Attr<bool>("fast_accumulation"));

int64_t JaxquantFp8TensorGemmWorkspaceBytes(int64_t m, int64_t n) {
  // An empty problem returns before touching its workspace.
  return m <= 0 || n <= 0 ? 0 : static_cast<int64_t>(jaxquant::lt_workspace_result_bytes());
}

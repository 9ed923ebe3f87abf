// The block FP8 GEMM's FFI handler: checks the buffers and dispatches on B's block shape
// and the output dtype. Problems go to cuBLASLt's block-scaled FP8 GEMM where it takes
// them (lt_gemm.h; on the H100 at 8192^3, against bf16: B in 128x128 tiles 1.59-1.61x,
// 1x128 x 1x128 1.27x, against 1.44x and 1.09x for the CUTLASS kernel, docs/kernels.md);
// what it declines to the CUTLASS instantiations in block_fp8_gemm_tiles.cu and
// block_fp8_gemm_rows.cu (see block_fp8_gemm.cuh for the kernel). The call's workspace is a
// result buffer XLA allocates with it (JaxquantBlockFp8GemmWorkspaceBytes sizes it), so XLA
// may capture the call into its command buffers.
#include <algorithm>

#include "block_fp8_gemm.cuh"
#include "jaxquant/bindings.h"
#include "lt_gemm.h"

JAXQUANT_BLOCK_FP8_GEMM_INSTANCES(extern, 1)
JAXQUANT_BLOCK_FP8_GEMM_INSTANCES(extern, 128)

namespace jaxquant {
namespace block_fp8_gemm_detail {
namespace {

// B's tile scales from the primitive's MN-major [kb, nb] to cuBLASLt's BLK128x128 layout,
// [nb, kb rounded up to 4] (padding zero).
__global__ void tile_scales_for_lt(const float* __restrict__ mn_major, int64_t kb, int64_t nb,
                                   int64_t kb_padded, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= nb * kb_padded) return;
  const int64_t row = i / kb_padded, col = i % kb_padded;
  out[i] = col < kb ? mn_major[col * nb + row] : 0.0f;
}

// The workspace: B's tile scales in cuBLASLt's layout (128x128 blocks only), then the GEMM's
// own workspace (cuBLASLt's or, where cuBLASLt declines, CUTLASS's), each from an aligned
// start.
struct WorkspaceLayout {
  int64_t kb_padded;   // k-blocks of a tile-scale row, padded to 4
  size_t tiles_bytes;  // 0 for 1x128 blocks
  size_t gemm_bytes;
  size_t total() const { return kWorkspaceAlignment + tiles_bytes + gemm_bytes; }
};

WorkspaceLayout workspace_layout(int64_t m, int64_t n, int64_t k, int32_t b_block_rows,
                                 bool f32_out, int device) {
  const int64_t kb = (k + kBlock - 1) / kBlock, nb = (n + kBlock - 1) / kBlock;
  const int64_t kb_padded = (kb + 3) / 4 * 4;
  const size_t tiles = b_block_rows == kBlock ? align_up(sizeof(float) * nb * kb_padded) : 0;
  auto cutlass_bytes = [&](auto out) {
    using TD = decltype(out);
    const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
    return b_block_rows == 1 ? cutlass_workspace_bytes<1, TD>(mi, ni, ki, device)
                             : cutlass_workspace_bytes<kBlock, TD>(mi, ni, ki, device);
  };
  const size_t cutlass = f32_out ? cutlass_bytes(float{}) : cutlass_bytes(cutlass::bfloat16_t{});
  return {kb_padded, tiles, std::max(kLtWorkspaceBytes, align_up(cutlass))};
}

// The cuBLASLt route: true when it ran, false when cuBLASLt has no algorithm for the
// problem. A's scales arrive in VEC128's layout, [kb, m] (m % 4 == 0, checked in Python);
// so do B's 1x128 ones, [kb, n]; B's tile scales are reordered for BLK128x128 into `tiles`.
ffi::ErrorOr<bool> through_lt(cudaStream_t stream, int32_t device, float* tiles,
                              const Workspace& gemm_workspace, const WorkspaceLayout& layout,
                              ffi::AnyBuffer a, ffi::AnyBuffer b, const float* sfa,
                              const float* sfb, ffi::Result<ffi::AnyBuffer>& d, int64_t m,
                              int64_t n, int64_t k, int32_t b_block_rows) {
  if (m % 4 != 0 || n % 4 != 0) return false;
  LtScales b_scales{CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, sfb};
  if (b_block_rows == kBlock) {
    const int64_t kb = (k + kBlock - 1) / kBlock, nb = (n + kBlock - 1) / kBlock;
    constexpr int kThreadsPerBlock = 256;
    const int64_t count = nb * layout.kb_padded;
    tile_scales_for_lt<<<static_cast<unsigned>((count + kThreadsPerBlock - 1) / kThreadsPerBlock),
                         kThreadsPerBlock, 0, stream>>>(sfb, kb, nb, layout.kb_padded, tiles);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) {
      return ffi::Unexpected(cuda_error("block_fp8_gemm: reordering B's scales", launched));
    }
    b_scales = {CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, tiles};
  }
  const cudaDataType_t td = d->element_type() == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  const LtOperand lt_a{
      a.untyped_data(), CUDA_R_8F_E4M3, {CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, sfa}};
  const LtOperand lt_b{b.untyped_data(), CUDA_R_8F_E4M3, b_scales};
  // Block scales are applied to each 128-deep block's sums, so cuBLASLt promotes them
  // there: no fast-accumulation mode to ask for.
  return lt_gemm(stream, device, gemm_workspace, lt_a, lt_b, /*device_alpha_beta=*/nullptr,
                 d->untyped_data(), td, m, n, k, /*fast_accumulation=*/false);
}

ffi::Error block_fp8_gemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Buffer<ffi::F32> sfa, ffi::Buffer<ffi::F32> sfb,
                          ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace,
                          int32_t b_block_rows) {
  const auto da = a.dimensions(), db = b.dimensions(), dd = d->dimensions();
  if (da.size() != 2 || db.size() != 2 || dd.size() != 2) {
    return invalid("block_fp8_gemm: expects A [M, K], B [N, K] and D [M, N]");
  }
  const int64_t m = da[0], k = da[1], n = db[0];
  const int64_t kb = (k + kBlock - 1) / kBlock;
  const int64_t nb = b_block_rows == 1 ? n : (n + kBlock - 1) / kBlock;
  if (db[1] != k || dd[0] != m || dd[1] != n || sfa.element_count() != kb * m ||
      sfb.element_count() != kb * nb) {
    return invalid("block_fp8_gemm: operand shapes disagree");
  }
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN) {
    return invalid("block_fp8_gemm: operands must be float8_e4m3fn");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  const bool f32_out = d->element_type() == ffi::DataType::F32;
  if (!f32_out && d->element_type() != ffi::DataType::BF16) {
    return invalid("block_fp8_gemm: the output dtype must be bfloat16 or float32");
  }
  if (b_block_rows != 1 && b_block_rows != kBlock) {
    return invalid("block_fp8_gemm: B's blocks must be 1x128 or 128x128");
  }
  const auto layout = workspace_layout(m, n, k, b_block_rows, f32_out, device);
  const Workspace given{workspace->untyped_data(), workspace->size_bytes()};
  if (auto err = check_workspace("block_fp8_gemm", given, layout.total()); err.failure())
    return err;
  auto* tiles = static_cast<float*>(given.after(0).data);
  const Workspace gemm_workspace = given.after(layout.tiles_bytes);
  auto ran = through_lt(stream, device, tiles, gemm_workspace, layout, a, b, sfa.typed_data(),
                        sfb.typed_data(), d, m, n, k, b_block_rows);
  if (ran.has_error()) return ran.error();
  if (*ran) return ffi::Error::Success();
  auto launch = [&](auto out) -> ffi::Error {
    using TD = decltype(out);
    const auto args =
        std::make_tuple(stream, std::cref(gemm_workspace), a.untyped_data(), b.untyped_data(),
                        sfa.typed_data(), sfb.typed_data(), d->untyped_data(), static_cast<int>(m),
                        static_cast<int>(n), static_cast<int>(k));
    return b_block_rows == 1 ? std::apply(run_block_fp8<1, TD>, args)
                             : std::apply(run_block_fp8<kBlock, TD>, args);
  };
  return f32_out ? launch(float{}) : launch(cutlass::bfloat16_t{});
}

}  // namespace
}  // namespace block_fp8_gemm_detail
}  // namespace jaxquant

int64_t JaxquantBlockFp8GemmWorkspaceBytes(int64_t m, int64_t n, int64_t k, int32_t b_block_rows,
                                           int32_t f32_out) {
  using namespace jaxquant::block_fp8_gemm_detail;
  if (m <= 0 || n <= 0) return 0;  // the handler returns before touching its workspace
  int device = 0;
  if ((b_block_rows != 1 && b_block_rows != kBlock) || cudaGetDevice(&device) != cudaSuccess) {
    return -1;
  }
  return static_cast<int64_t>(
      workspace_layout(m, n, k, b_block_rows, f32_out != 0, device).total());
}

JAXQUANT_DEFINE_HANDLER(JaxquantBlockFp8Gemm, jaxquant::block_fp8_gemm_detail::block_fp8_gemm,
                        jaxquant::scaled_gemm_binding()
                            .Ret<xla::ffi::AnyBuffer>()  // workspace
                            .Attr<int32_t>("b_block_rows"));

// Per-tensor FP8 cast with the transposed columnwise copy in the same pass
// (NUMERICS.md "Per-tensor FP8"). The scale comes from a device-side scalar: the amax
// (current scaling, the scale is derived here) or the scale itself (delayed scaling).
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

template <typename T> constexpr int kTileRows = kCastTileRows<T>;

struct Fp8TensorOut {
  uint8_t* row_data;   // [M, K]
  float* row_scale_inv;
  uint8_t* col_data;   // [K, M]
  float* col_scale_inv;
};

template <typename T>
__global__ __launch_bounds__(kThreads, kMinBlocks) void fp8_tensor_cast_kernel(
    const T* __restrict__ x, const float* __restrict__ amax_or_scale, int64_t M, int64_t K,
    KernelConfig cfg, Fp8TensorOut out) {
  constexpr int V = kVec<T>, TC = kTileCols<T>, kRowPasses = kTileRows<T> / kWarps;
  __shared__ Vec16<T> tile[kTileRows<T>][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTileRows<T>;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * TC;
  const int64_t col = k0 + lane * V;

  Vec16<T> v[kRowPasses];
#pragma unroll
  for (int p = 0; p < kRowPasses; ++p) {
    const int64_t row = m0 + warp + p * kWarps;
    v[p] = (row < M && col < K) ? load_vec(x + row * K + col) : zero_vec<T>();
  }

  const float scale = cfg.given_scale ? *amax_or_scale
                                      : fp8_scale_from_amax<T>(*amax_or_scale,
                                                               element_max(cfg.element),
                                                               cfg.eps, cfg.pow2_scales);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    const float scale_inv = 1.0f / scale;
    if (out.row_scale_inv) *out.row_scale_inv = scale_inv;
    if (out.col_scale_inv) *out.col_scale_inv = scale_inv;
  }

  if (out.col_data != nullptr) {
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) tile[warp + p * kWarps][lane] = v[p];
  }

  if (out.row_data != nullptr && col < K) {
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
      const int64_t row = m0 + warp + p * kWarps;
      if (row >= M) break;
      uint32_t codes[V / 4];
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        codes[i / 4] =
            fp8x2_code(to_float(v[p].v[i]) * scale, to_float(v[p].v[i + 1]) * scale, cfg.element) |
            (fp8x2_code(to_float(v[p].v[i + 2]) * scale, to_float(v[p].v[i + 3]) * scale,
                        cfg.element) << 16);
      }
      uint8_t* dst = out.row_data + row * K + col;
      if constexpr (V == 8) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(codes[0], codes[1]);
      } else {
        *reinterpret_cast<uint32_t*>(dst) = codes[0];
      }
    }
  }

  if (out.col_data != nullptr) {
    __syncthreads();
    // Each thread writes 16 contiguous bytes of a transposed row per chunk.
    constexpr int kChunk = 16, kParts = kThreads / TC, kRowsPerPart = kTileRows<T> / kParts;
    const int c = threadIdx.x % TC, part = threadIdx.x / TC;
    const int64_t k = k0 + c;
    const T* column = reinterpret_cast<const T*>(&tile[0][0]) + c;
    if (k < K) {
#pragma unroll
      for (int b = 0; b < kRowsPerPart / kChunk; ++b) {
        const int r0 = part * kRowsPerPart + b * kChunk;
        if (m0 + r0 >= M) break;
        uint32_t codes[kChunk / 4];
#pragma unroll
        for (int i = 0; i < kChunk; i += 4) {
          codes[i / 4] =
              fp8x2_code(to_float(column[(r0 + i) * TC]) * scale,
                         to_float(column[(r0 + i + 1) * TC]) * scale, cfg.element) |
              (fp8x2_code(to_float(column[(r0 + i + 2) * TC]) * scale,
                          to_float(column[(r0 + i + 3) * TC]) * scale, cfg.element) << 16);
        }
        *reinterpret_cast<uint4*>(out.col_data + k * M + m0 + r0) =
            make_uint4(codes[0], codes[1], codes[2], codes[3]);
      }
    }
  }
}

ffi::Error fp8_tensor_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer amax_or_scale,
                           ffi::AnyBuffer /*col_amax: the same*/, ffi::AnyBuffer /*seed*/,
                           ffi::RemainingRets rets, KernelConfig cfg) {
  int64_t M, K;
  if (!matrix_dims(x, M, K)) return invalid("fp8_tensor_cast: x must be rank 2");
  if (M % 16 || K % 16) return invalid("fp8_tensor_cast: dims must be multiples of 16");
  if (amax_or_scale.element_type() != ffi::DataType::F32 ||
      amax_or_scale.element_count() != 1) {
    return invalid("fp8_tensor_cast: amax / scale must be one float32");
  }
  Fp8TensorOut out{};
  size_t next = 0;
  if (cfg.rowwise) {
    auto d = result_ptr<uint8_t>(rets, next++);
    auto s = result_ptr<float>(rets, next++);
    if (!d.has_value() || !s.has_value()) return invalid("fp8_tensor_cast: missing rowwise results");
    out.row_data = *d;
    out.row_scale_inv = *s;
  }
  if (cfg.columnwise) {
    auto d = result_ptr<uint8_t>(rets, next++);
    auto s = result_ptr<float>(rets, next++);
    if (!d.has_value() || !s.has_value()) return invalid("fp8_tensor_cast: missing columnwise results");
    out.col_data = *d;
    out.col_scale_inv = *s;
  }
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    // An empty tensor still gets its scale_inv: one CTA that touches no element.
    const dim3 grid(M == 0 ? 1 : (M + kTileRows<T> - 1) / kTileRows<T>,
                    K == 0 ? 1 : (K + kTileCols<T> - 1) / kTileCols<T>);
    fp8_tensor_cast_kernel<T><<<grid, kThreads, 0, stream>>>(
        reinterpret_cast<const T*>(x.untyped_data()),
        reinterpret_cast<const float*>(amax_or_scale.untyped_data()), M, K, cfg, out);
    return cuda_status("fp8_tensor_cast");
  });
}

}  // namespace
}  // namespace jaxquant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxquantFp8TensorCast, jaxquant::fp8_tensor_cast,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // amax or delayed scale
                                  .Arg<xla::ffi::AnyBuffer>()  // col amax (the same, unused)
                                  .Arg<xla::ffi::AnyBuffer>()  // seed (unused)
                                  .RemainingRets()
                                  .Attrs<jaxquant::KernelConfig>());

// MXFP8 cast, rowwise and columnwise in one pass (NUMERICS.md "MXFP8").
//
// Tiles and the work split are tile.cuh's staged cast tiles. A rowwise block of 32 spans
// 32 / kVec consecutive lanes of one row; a columnwise block (32 rows of one column) spans
// 8 consecutive lanes of a warp, 4 rows each. Block amaxes are reduced with shuffles.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

// Four 32 KB tile stages, so one CTA per SM: 0.81 of a copy in a micro-benchmark at
// 16384 x 8192 bf16, against 0.79 for three stages and two CTAs.
constexpr int kStages = 4;

constexpr int kBlock = 32;
// Tiles per strip, at most (tile.cuh): 8 tiles give each row 32 bytes of rowwise scales
// (bf16 input), one whole sector.
constexpr int kMaxStripShift = 3;

struct Mxfp8Out {
  uint8_t* row_data;   // [M, K]
  uint8_t* row_scale;  // [M, K / 32]
  uint8_t* col_data;   // [K, M]
  uint8_t* col_scale;  // [K, M / 32]
};

// Codes of f[i] * mult for four elements of one block, packed little-endian. Only a block
// whose amax is NaN holds NaN, so only such a block pays for the NaN rewrite.
template <int32_t kElement>
__device__ __forceinline__ uint32_t mxfp8x4_code(float f0, float f1, float f2, float f3,
                                                 float mult, bool nan_block) {
  return nan_block ? fp8x4_code(f0 * mult, f1 * mult, f2 * mult, f3 * mult, kElement)
                   : fp8x4_code_no_nan(f0 * mult, f1 * mult, f2 * mult, f3 * mult, kElement);
}

template <typename T, int32_t kElement>
__global__ __launch_bounds__(kCastThreads, kCastMinBlocks) void mxfp8_cast_kernel(
    const T* __restrict__ x, int64_t M, int64_t K, int strip_shift, Mxfp8Out out) {
  constexpr int V = kVec<T>, kTileBlocks = kCastCols<T> / kBlock;
  constexpr int kStripBytes = (1 << kMaxStripShift) * kTileBlocks;
  // The rowwise scales of the current strip, stored once it is done (tile.cuh).
  __shared__ __align__(16) uint8_t strip_scales[kCastRows][kStripBytes];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr float fmax = element_max(kElement);

  // Shuffles run on every lane; only stores depend on the range checks. Output pointers
  // step by whole rows, so each store costs one 64-bit add.
  const int64_t row_scales = K / kBlock, col_scales = M / kBlock;
  auto store_row_scales = [&](TileOrigin first, int tiles) {
    if (out.row_data != nullptr) {
      store_strip_scales<kBlock>(strip_scales, out.row_scale, M, row_scales, first,
                                 tiles * kTileBlocks);
    }
  };
  for_each_cast_tile<kStages>(x, M, K, strip_shift, [&](const CastTile<T>& tile, TileOrigin o) {
    if (out.row_data != nullptr) {
      constexpr int kLanesPerBlock = kBlock / V;
      const int q = row_pass_chunk();
      const int64_t m_first = o.m0 + row_pass_row(0), k = o.k0 + q * V;
      uint8_t* data = out.row_data + m_first * K + k;
      const int in_strip = static_cast<int>(o.k0 / kCastCols<T>) & ((1 << strip_shift) - 1);
      const int scale_byte = in_strip * kTileBlocks + q / kLanesPerBlock;
#pragma unroll
      for (int i = 0; i < kCastRowPasses; ++i) {
        const Vec16<T> v = tile.at(row_pass_row(i), q);
        const float a = chunk_amax(v, kLanesPerBlock);
        const uint32_t e = mxfp8_scale_byte(a, fmax);
        const float mult = mxfp8_quant_multiplier(e);
        uint32_t codes[V / 4];
#pragma unroll
        for (int j = 0; j < V; j += 4) {
          codes[j / 4] = mxfp8x4_code<kElement>(element_float(v, j), element_float(v, j + 1),
                                                element_float(v, j + 2), element_float(v, j + 3),
                                                mult, isnan(a));
        }
        if (q % kLanesPerBlock == 0) strip_scales[row_pass_row(i)][scale_byte] = e;
        if (m_first + i * kCastPassRows < M && k < K) {
          if constexpr (V == 8) {
            *reinterpret_cast<uint2*>(data) = make_uint2(codes[0], codes[1]);
          } else {
            *reinterpret_cast<uint32_t*>(data) = codes[0];
          }
        }
        data += kCastPassRows * K;
      }
    }
    if (out.col_data != nullptr) {
      // Lane l holds rows 4l .. 4l+3 of chunk column `warp`; a 32-row block is 8 lanes.
      const int64_t k_first = o.k0 + warp * V, m = o.m0 + 4 * lane;
      Vec16<T> c[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = tile.at(4 * lane + j, warp);
      float a[V];
      column_amaxes(c, kBlock / 4, a);
      const bool in_range = k_first < K && m < M;
      // One branch per lane and tile on "any NaN block", not one per column.
      auto store_columns = [&](auto nan_blocks) {
        uint8_t* data = out.col_data + k_first * M + m;
        uint8_t* scale = out.col_scale + k_first * col_scales + m / kBlock;
#pragma unroll
        for (int e = 0; e < V; ++e, data += M, scale += col_scales) {
          const uint32_t s = mxfp8_scale_byte(a[e], fmax);
          const uint32_t codes = mxfp8x4_code<kElement>(
              element_float(c[0], e), element_float(c[1], e), element_float(c[2], e),
              element_float(c[3], e), mxfp8_quant_multiplier(s), decltype(nan_blocks)::value);
          if (in_range) {
            *reinterpret_cast<uint32_t*>(data) = codes;
            if (lane % (kBlock / 4) == 0) *scale = s;
          }
        }
      };
      float any = 0.0f;
#pragma unroll
      for (int e = 0; e < V; ++e) any = amax_combine(any, a[e]);
      if (isnan(any)) {
        store_columns(std::true_type{});
      } else {
        store_columns(std::false_type{});
      }
    }
  }, store_row_scales);
}

ffi::Error mxfp8_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer /*row_amax*/,
                      ffi::AnyBuffer /*col_amax*/, ffi::AnyBuffer /*seed*/, ffi::RemainingRets rets,
                      KernelConfig cfg) {
  int64_t M, K;
  if (!matrix_dims(x, M, K)) return invalid("mxfp8_cast: x must be rank 2");
  if (M % kBlock || K % kBlock) return invalid("mxfp8_cast: dims must be multiples of 32");
  if (cfg.element != kE4M3 && cfg.element != kE5M2) return invalid("mxfp8_cast: element");
  Mxfp8Out out{};
  if (auto err = take_cast_results(rets, cfg, "mxfp8_cast", out); err.failure()) return err;
  if (M == 0 || K == 0) return ffi::Error::Success();
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      constexpr size_t smem = kCastStageBytes<T, kStages>;
      CastPlan plan{};
      const cudaError_t err = plan_cast<T>(kernel, M, K, smem, kMaxStripShift, plan);
      if (err != cudaSuccess) return cuda_error("mxfp8_cast: launch plan", err);
      kernel<<<plan.grid, kCastThreads, smem, stream>>>(
          reinterpret_cast<const T*>(x.untyped_data()), M, K, plan.strip_shift, out);
      return cuda_status("mxfp8_cast");
    };
    return cfg.element == kE4M3 ? launch(mxfp8_cast_kernel<T, kE4M3>)
                                : launch(mxfp8_cast_kernel<T, kE5M2>);
  });
}

}  // namespace
}  // namespace jaxquant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxquantMxfp8Cast, jaxquant::mxfp8_cast,
                              jaxquant::cast_binding(), JAXQUANT_CMD_BUFFER_SAFE);

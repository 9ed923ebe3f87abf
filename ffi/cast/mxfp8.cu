// MXFP8 cast, rowwise and columnwise in one pass (NUMERICS.md "MXFP8").
//
// Tiles and the work split are tile.cuh's staged cast tiles. A rowwise block of 32 spans
// 32 / kVec consecutive lanes of one row; a columnwise block (32 rows of one column) spans
// 8 consecutive lanes of a warp, 4 rows each. Block amaxes are reduced with shuffles.
//
// The values handler (jaxquant_mxfp8_values) is the same pass writing, instead of codes
// and scales, each usage's dequantized values in bf16, what a GEMM that dequantizes first
// multiplies: code times 2^(e - 127), the dequantize kernel's products (dequantize.cu),
// which bf16 holds exactly. Hopper has no MXFP8 tensor cores, so its GEMMs take these
// values and need no dequantize pass of their own.
#include <string>
#include <utility>

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
  uint8_t* row_data;   // [M, K] codes; bf16 values in the values kernel
  uint8_t* row_scale;  // [M, K / 32]; unused in the values kernel
  uint8_t* col_data;   // [K, M] codes; bf16 values in the values kernel
  uint8_t* col_scale;  // [K, M / 32]; unused in the values kernel
};

// The bf16 values of four codes of one block with scale byte e, packed little-endian:
// the dequantize kernel's fp32 products code * 2^(e - 127), rounded to bf16 (exact).
template <int32_t kElement>
__device__ __forceinline__ uint2 mxfp8x4_values(uint32_t codes, uint32_t e) {
  const float s = e8m0_to_float(static_cast<uint8_t>(e));
  const float2 lo = fp8x2_to_float2(codes, kElement), hi = fp8x2_to_float2(codes >> 16, kElement);
  const __nv_bfloat16 v[4] = {
      from_float<__nv_bfloat16>(lo.x * s), from_float<__nv_bfloat16>(lo.y * s),
      from_float<__nv_bfloat16>(hi.x * s), from_float<__nv_bfloat16>(hi.y * s)};
  return *reinterpret_cast<const uint2*>(v);
}

// Codes of f[i] * mult for four elements of one block, packed little-endian. Only a block
// whose amax is NaN holds NaN, so only such a block pays for the NaN rewrite.
template <int32_t kElement>
__device__ __forceinline__ uint32_t mxfp8x4_code(float f0, float f1, float f2, float f3, float mult,
                                                 bool nan_block) {
  return nan_block ? fp8x4_code(f0 * mult, f1 * mult, f2 * mult, f3 * mult, kElement)
                   : fp8x4_code_no_nan(f0 * mult, f1 * mult, f2 * mult, f3 * mult, kElement);
}

template <typename T, int32_t kElement, bool kValues>
__global__ __launch_bounds__(kCastThreads,
                             kCastMinBlocks) void mxfp8_cast_kernel(const T* __restrict__ x,
                                                                    int64_t M, int64_t K,
                                                                    int strip_shift, Mxfp8Out out) {
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
    if (!kValues && out.row_data != nullptr) {
      store_strip_scales<kBlock>(strip_scales, out.row_scale, M, row_scales, first,
                                 tiles * kTileBlocks);
    }
  };
  for_each_cast_tile<kStages>(
      x, M, K, strip_shift,
      [&](const CastTile<T>& tile, TileOrigin o) {
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
                                                    element_float(v, j + 2),
                                                    element_float(v, j + 3), mult, isnan(a));
            }
            if (!kValues && q % kLanesPerBlock == 0) strip_scales[row_pass_row(i)][scale_byte] = e;
            if (m_first + i * kCastPassRows < M && k < K) {
              if constexpr (kValues) {
                // `data` counts codes: the bf16 values sit at twice its offset.
                uint2* values = reinterpret_cast<uint2*>(out.row_data + 2 * (data - out.row_data));
#pragma unroll
                for (int j = 0; j < V / 4; ++j) values[j] = mxfp8x4_values<kElement>(codes[j], e);
              } else if constexpr (V == 8) {
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
                if constexpr (kValues) {
                  *reinterpret_cast<uint2*>(out.col_data + 2 * (data - out.col_data)) =
                      mxfp8x4_values<kElement>(codes, s);
                } else {
                  *reinterpret_cast<uint32_t*>(data) = codes;
                  if (lane % (kBlock / 4) == 0) *scale = s;
                }
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
      },
      store_row_scales);
}

template <bool kValues>
ffi::Error launch_mxfp8(cudaStream_t stream, ffi::AnyBuffer x, int64_t M, int64_t K,
                        int32_t element, const Mxfp8Out& out, const char* what) {
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto kernel) {
      constexpr size_t smem = kCastStageBytes<T, kStages>;
      CastPlan plan{};
      const cudaError_t err = plan_cast<T>(kernel, M, K, smem, kMaxStripShift, plan);
      if (err != cudaSuccess) return cuda_error((std::string(what) + ": launch plan").c_str(), err);
      kernel<<<plan.grid, kCastThreads, smem, stream>>>(
          reinterpret_cast<const T*>(x.untyped_data()), M, K, plan.strip_shift, out);
      return cuda_status(what);
    };
    return element == kE4M3 ? launch(mxfp8_cast_kernel<T, kE4M3, kValues>)
                            : launch(mxfp8_cast_kernel<T, kE5M2, kValues>);
  });
}

ffi::Error check_mxfp8_input(ffi::AnyBuffer x, int32_t element, int64_t& M, int64_t& K,
                             const std::string& what) {
  if (!matrix_dims(x, M, K)) return invalid(what + ": x must be rank 2");
  if (M % kBlock || K % kBlock) return invalid(what + ": dims must be multiples of 32");
  if (element != kE4M3 && element != kE5M2) return invalid(what + ": element");
  return ffi::Error::Success();
}

ffi::Error mxfp8_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer /*row_amax*/,
                      ffi::AnyBuffer /*col_amax*/, ffi::AnyBuffer /*seed*/, ffi::RemainingRets rets,
                      CastConfig cfg) {
  int64_t M, K;
  if (auto err = check_mxfp8_input(x, cfg.element, M, K, "mxfp8_cast"); err.failure()) return err;
  Mxfp8Out out{};
  if (auto err = take_cast_results(rets, cfg, "mxfp8_cast", out); err.failure()) return err;
  if (M == 0 || K == 0) return ffi::Error::Success();
  return launch_mxfp8<false>(stream, x, M, K, cfg.element, out, "mxfp8_cast");
}

// Results: the rowwise values [M, K] if `rowwise`, then the columnwise values [K, M] if
// `columnwise`, bf16 (kernels/_gemm_values.py).
ffi::Error mxfp8_values(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets,
                        int32_t element, int32_t rowwise, int32_t columnwise) {
  int64_t M, K;
  if (auto err = check_mxfp8_input(x, element, M, K, "mxfp8_values"); err.failure()) return err;
  Mxfp8Out out{};
  size_t next = 0;
  for (auto [wanted, data] :
       {std::pair{rowwise, &out.row_data}, std::pair{columnwise, &out.col_data}}) {
    if (!wanted) continue;
    auto values = result_ptr<uint8_t>(rets, next++);
    if (!values.has_value()) return invalid("mxfp8_values: missing results");
    *data = *values;
  }
  if (M == 0 || K == 0) return ffi::Error::Success();
  return launch_mxfp8<true>(stream, x, M, K, element, out, "mxfp8_values");
}

auto mxfp8_values_binding() {
  return stream_binding()
      .Arg<ffi::AnyBuffer>()  // x
      .RemainingRets()
      .Attr<int32_t>("element")
      .Attr<int32_t>("rowwise")
      .Attr<int32_t>("columnwise");
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantMxfp8Cast, jaxquant::mxfp8_cast, jaxquant::cast_binding());
JAXQUANT_DEFINE_HANDLER(JaxquantMxfp8Values, jaxquant::mxfp8_values,
                        jaxquant::mxfp8_values_binding());

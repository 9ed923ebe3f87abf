// Per-tensor FP8 cast with the transposed columnwise copy in the same pass
// (NUMERICS.md "Per-tensor FP8"). The scale comes from a device-side scalar: the amax
// (current scaling, the scale is derived here) or the scale itself (delayed scaling).
// With delayed scaling the cast also takes the input's amax as it reads it
// (cfg.observe_amax), the one the step records: no second pass over the tensor.
// Tiles and the work split are tile.cuh's staged cast tiles.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

// Three 32 KB tile stages: two CTAs of 512 threads fit an SM (registers and shared memory).
// One tile per strip (tile.cuh): there are no strip-wide stores, and longer strips measured
// slower on small inputs (0.89 against 0.92 of a copy at 4096 x 4096).
constexpr int kStages = 3;

struct Fp8TensorOut {
  uint8_t* row_data;  // [M, K]
  float* row_scale;   // the decode scale (scale_inv): one float
  uint8_t* col_data;  // [K, M]
  float* col_scale;   // the same
  float* amax;        // the input's amax (cfg.observe_amax), zeroed before the launch; or null
};

// Four codes of x * scale, packed little-endian; only `may_be_nan` inputs pay for the
// NaN rewrite.
template <int32_t kElement>
__device__ __forceinline__ uint32_t fp8x4_scaled(float a, float b, float c, float d, float scale,
                                                 bool may_be_nan) {
  return may_be_nan ? fp8x4_code(a * scale, b * scale, c * scale, d * scale, kElement)
                    : fp8x4_code_no_nan(a * scale, b * scale, c * scale, d * scale, kElement);
}

// The tensor's scale from the amax or the given (delayed) scale, and whether a product can
// be NaN with no NaN input: a delayed scale may be any float, and 0 or inf times a scale
// that is not finite and positive is NaN. The first thread stores scale_inv.
struct TensorScale {
  float scale;
  bool may_make_nan;
};

template <typename T, int32_t kElement>
__device__ __forceinline__ TensorScale tensor_scale(const float* amax_or_scale,
                                                    const CastConfig& cfg,
                                                    const Fp8TensorOut& out) {
  const float scale =
      cfg.given_scale
          ? *amax_or_scale
          : fp8_scale_from_amax<T>(*amax_or_scale, element_max(kElement), cfg.eps, cfg.pow2_scales);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const float scale_inv = 1.0f / scale;
    if (out.row_scale) *out.row_scale = scale_inv;
    if (out.col_scale) *out.col_scale = scale_inv;
  }
  return {scale, !(scale > 0.0f && scale <= kFltMax)};
}

// The codes of one 16-byte vector of a row, stored at dst; returns the vector's amax.
template <typename T, int32_t kElement>
__device__ __forceinline__ float store_row_vector(const Vec16<T>& v, const TensorScale& s,
                                                  uint8_t* dst) {
  constexpr int V = kVec<T>;
  const float amax = chunk_amax(v, 1);
  const bool nan = s.may_make_nan || isnan(amax);
  uint32_t codes[V / 4];
#pragma unroll
  for (int j = 0; j < V; j += 4) {
    codes[j / 4] =
        fp8x4_scaled<kElement>(element_float(v, j), element_float(v, j + 1),
                               element_float(v, j + 2), element_float(v, j + 3), s.scale, nan);
  }
  if constexpr (V == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(codes[0], codes[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = codes[0];
  }
  return amax;
}

// The rowwise usage alone keeps x's layout: a tensor of 16-byte vectors in, of codes out,
// with no tile to stage. Grid-stride from the start (the amax pass read the tensor from
// its end, so the first reads find it in L2), four vectors in flight per thread.
template <typename T, int32_t kElement>
__global__ __launch_bounds__(kThreads) void fp8_tensor_rows_kernel(
    const T* __restrict__ x, const float* __restrict__ amax_or_scale, int64_t vectors,
    CastConfig cfg, Fp8TensorOut out) {
  constexpr int V = kVec<T>;
  const TensorScale s = tensor_scale<T, kElement>(amax_or_scale, cfg, out);
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  float seen = 0.0f;
  for (; i + 3 * stride < vectors; i += 4 * stride) {
    Vec16<T> v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = xv[i + j * stride];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      seen = amax_combine(
          seen, store_row_vector<T, kElement>(v[j], s, out.row_data + (i + j * stride) * V));
    }
  }
  for (; i < vectors; i += stride) {
    seen = amax_combine(seen, store_row_vector<T, kElement>(xv[i], s, out.row_data + i * V));
  }
  if (out.amax != nullptr) publish_cta_amax<kWarps>(seen, out.amax);
}

template <typename T, int32_t kElement>
__global__ __launch_bounds__(kCastThreads, kCastMinBlocks) void fp8_tensor_cast_kernel(
    const T* __restrict__ x, const float* __restrict__ amax_or_scale, int64_t M, int64_t K,
    CastConfig cfg, Fp8TensorOut out) {
  constexpr int V = kVec<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const TensorScale s = tensor_scale<T, kElement>(amax_or_scale, cfg, out);
  // The amax of what this thread read: from the rowwise pass where there is one, else from
  // the columnwise one (each covers every element of the tile once).
  float seen = 0.0f;

  auto cast_tile = [&](const CastTile<T>& tile, TileOrigin o) {
    if (out.row_data != nullptr) {
      const int q = row_pass_chunk();
#pragma unroll
      for (int i = 0; i < kCastRowPasses; ++i) {
        const int r = row_pass_row(i);
        const int64_t m = o.m0 + r, k = o.k0 + q * V;
        if (m >= M || k >= K) continue;
        seen = amax_combine(
            seen, store_row_vector<T, kElement>(tile.at(r, q), s, out.row_data + m * K + k));
      }
    }
    // Columnwise: lane l writes 4 codes (rows 4l .. 4l+3) of each transposed row k.
    const int64_t k_first = o.k0 + warp * V, m = o.m0 + 4 * lane;
    if (out.col_data != nullptr && k_first < K && m < M) {
      Vec16<T> c[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j] = tile.at(4 * lane + j, warp);
      const float amax = amax_combine(amax_combine(chunk_amax(c[0], 1), chunk_amax(c[1], 1)),
                                      amax_combine(chunk_amax(c[2], 1), chunk_amax(c[3], 1)));
      if (out.row_data == nullptr) seen = amax_combine(seen, amax);
      const bool nan = s.may_make_nan || isnan(amax);
      // One branch per lane and tile, not per store.
      auto store_columns = [&](auto may_be_nan) {
        uint8_t* data = out.col_data + k_first * M + m;
#pragma unroll
        for (int e = 0; e < V; ++e, data += M) {
          *reinterpret_cast<uint32_t*>(data) = fp8x4_scaled<kElement>(
              element_float(c[0], e), element_float(c[1], e), element_float(c[2], e),
              element_float(c[3], e), s.scale, decltype(may_be_nan)::value);
        }
      };
      if (nan) {
        store_columns(std::true_type{});
      } else {
        store_columns(std::false_type{});
      }
    }
  };
  for_each_cast_tile<kStages>(x, M, K, /*strip_shift=*/0, cast_tile, NoStripEnd{});
  if (out.amax != nullptr) publish_cta_amax<kCastWarps>(seen, out.amax);
}

ffi::Error fp8_tensor_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer amax_or_scale,
                           ffi::AnyBuffer /*col_amax: the same*/, ffi::AnyBuffer /*seed*/,
                           ffi::RemainingRets rets, CastConfig cfg) {
  int64_t M, K;
  if (!matrix_dims(x, M, K)) return invalid("fp8_tensor_cast: x must be rank 2");
  if (M % 16 || K % 16) return invalid("fp8_tensor_cast: dims must be multiples of 16");
  if (cfg.element != kE4M3 && cfg.element != kE5M2) {
    return invalid("fp8_tensor_cast: element must be E4M3 or E5M2");
  }
  if (amax_or_scale.element_type() != ffi::DataType::F32 || amax_or_scale.element_count() != 1) {
    return invalid("fp8_tensor_cast: amax / scale must be one float32");
  }
  Fp8TensorOut out{};
  if (auto err = take_cast_results(rets, cfg, "fp8_tensor_cast", out); err.failure()) return err;
  if (cfg.observe_amax) {
    auto amax = result_ptr<float>(rets, 2 * ((cfg.rowwise != 0) + (cfg.columnwise != 0)));
    if (!amax.has_value()) return invalid("fp8_tensor_cast: missing the amax result");
    out.amax = *amax;
    if (auto err = cuda_error("fp8_tensor_cast: zeroing the amax",
                              cudaMemsetAsync(out.amax, 0, sizeof(float), stream));
        err.failure()) {
      return err;
    }
  }
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    // An empty tensor still gets its scale_inv: one CTA that touches no element.
    if (out.col_data == nullptr && out.row_data != nullptr) {
      const int64_t vectors = M * K / kVec<T>;
      auto rows = cfg.element == kE4M3 ? fp8_tensor_rows_kernel<T, kE4M3>
                                       : fp8_tensor_rows_kernel<T, kE5M2>;
      rows<<<streaming_ctas(vectors), kThreads, 0, stream>>>(
          reinterpret_cast<const T*>(x.untyped_data()),
          reinterpret_cast<const float*>(amax_or_scale.untyped_data()), vectors, cfg, out);
      return cuda_status("fp8_tensor_cast");
    }
    auto launch = [&](auto kernel) {
      constexpr size_t smem = kCastStageBytes<T, kStages>;
      CastPlan plan{};
      const cudaError_t err = plan_cast<T>(kernel, M, K, smem, /*max_strip_shift=*/0, plan);
      if (err != cudaSuccess) return cuda_error("fp8_tensor_cast: launch plan", err);
      // Named first: clang-format splits `<<<` when a launch argument holds a bare `>`.
      const int grid = plan.grid > 0 ? plan.grid : 1;
      kernel<<<grid, kCastThreads, smem, stream>>>(
          reinterpret_cast<const T*>(x.untyped_data()),
          reinterpret_cast<const float*>(amax_or_scale.untyped_data()), M, K, cfg, out);
      return cuda_status("fp8_tensor_cast");
    };
    return cfg.element == kE4M3 ? launch(fp8_tensor_cast_kernel<T, kE4M3>)
                                : launch(fp8_tensor_cast_kernel<T, kE5M2>);
  });
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantFp8TensorCast, jaxquant::fp8_tensor_cast, jaxquant::cast_binding());

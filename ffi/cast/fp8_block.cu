// Block FP8 cast (NUMERICS.md "Block FP8"): an fp32 scale per 1x128 block along the
// usage's block dim, or per 128x128 tile shared by both usages. Edge blocks may be
// partial: the amax covers only real elements (the tile is zero-filled past the edge).
//
// Tile: 128 rows x (32 lanes x one 16-byte vector) columns, staged in dynamic shared
// memory (64 KiB) for both usages. A 128-element rowwise block spans 128 / kVec lanes; a
// columnwise block is one thread's column of the tile.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

constexpr int kTileRows = 128;
constexpr int kBlock = 128;

struct BlockOut {
  uint8_t* row_data;  // [M, K]
  float* row_scale;   // [M, ceil(K/128)] or [ceil(M/128), ceil(K/128)]
  uint8_t* col_data;  // [K, M]
  float* col_scale;   // [K, ceil(M/128)] or [ceil(K/128), ceil(M/128)]
};

struct BlockScale {
  float scale, scale_inv;
};

template <typename T>
__device__ __forceinline__ BlockScale block_scale(float amax, const CastConfig& cfg) {
  const float s = fp8_scale_from_amax<T>(amax, element_max(cfg.element), cfg.eps, cfg.pow2_scales);
  return {s, 1.0f / s};
}

// Quantizes one lane's vector of a row and stores its kVec codes.
template <typename T>
__device__ __forceinline__ void store_row_codes(const Vec16<T>& w, float scale, int32_t element,
                                                uint8_t* dst) {
  constexpr int V = kVec<T>;
  uint32_t codes[V / 4];
#pragma unroll
  for (int i = 0; i < V; i += 4) {
    codes[i / 4] =
        fp8x2_code(to_float(w.v[i]) * scale, to_float(w.v[i + 1]) * scale, element) |
        (fp8x2_code(to_float(w.v[i + 2]) * scale, to_float(w.v[i + 3]) * scale, element) << 16);
  }
  if constexpr (V == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(codes[0], codes[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = codes[0];
  }
}

// The 1x128 block amaxes of a warp's kRows row passes, one per lane: lane l ends with the
// amax of row pass l % kRows over the kLanes lanes of its block, given each lane's own
// amax of every row (part). Each exchange hands the partner lane the half of the rows it
// keeps (recursive halving), so a warp spends 15 shuffles instead of 4 per row, and computes its
// 32 block scales (two IEEE divisions each) in one pass instead of one per row: the row
// scales were most of the 1x128 cast's extra instructions (ncu).
template <int kRows, int kLanes>
__device__ __forceinline__ float block_amaxes_across_lanes(float (&part)[kRows]) {
  static_assert((kRows & (kRows - 1)) == 0 && kRows <= kLanes && kLanes <= 32,
                "kRows a power of two, and a block spans at least kRows lanes of one warp");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int half = kRows / 2; half >= 1; half /= 2) {
    const bool upper = lane & half;  // keeps rows [half, 2 half) of the ones left
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float give = upper ? part[i] : part[i + half];
      const float keep = upper ? part[i + half] : part[i];
      part[i] = amax_combine(keep, __shfl_xor_sync(0xFFFFFFFFu, give, half));
    }
  }
  float a = part[0];  // lanes kRows apart within a block hold the same row
#pragma unroll
  for (int off = kRows; off < kLanes; off <<= 1) {
    a = amax_combine(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
  }
  return a;
}

template <typename T, bool kTile2d>
__global__ __launch_bounds__(kThreads, 1) void fp8_block_cast_kernel(const T* __restrict__ x,
                                                                     int64_t M, int64_t K,
                                                                     CastConfig cfg, BlockOut out) {
  constexpr int V = kVec<T>, TC = kTileCols<T>, kRowPasses = kTileRows / kWarps;
  constexpr int kTilesAcross = TC / kBlock;
  extern __shared__ uint4 smem[];  // one declaration for every T: extern shared arrays alias
  Vec16<T>(*tile)[32] = reinterpret_cast<Vec16<T>(*)[32]>(smem);
  __shared__ float warp_amax[kWarps];
  __shared__ BlockScale tile_scale[kTilesAcross];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * TC;
  const int64_t col = k0 + lane * V;
  const int64_t row_blocks = (K + kBlock - 1) / kBlock, col_blocks = (M + kBlock - 1) / kBlock;

  {
    // Every load is issued before the first store to shared memory; the registers they
    // fill are dead once the tile is staged. (Quantizing the 1x128 rows from these
    // registers kept all of them live through the block reductions: 181 registers a
    // thread, one CTA per SM, a third of the copy bandwidth; ncu.)
    Vec16<T> v[kRowPasses];
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
      const int64_t row = m0 + warp + p * kWarps;
      v[p] = (row < M && col < K) ? load_vec(x + row * K + col) : zero_vec<T>();
    }
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) tile[warp + p * kWarps][lane] = v[p];
  }
  __syncthreads();

  // Column phase (columnwise usage, and the 128x128 tile scales): thread c owns tile
  // column c (threads past TC only help reduce).
  if (out.col_data != nullptr || kTile2d) {
    const int c = threadIdx.x;
    const int64_t k = k0 + c;
    const T* column = reinterpret_cast<const T*>(&tile[0][0]) + c;
    float a = 0.0f;
    if (c < TC) {
      for (int r = 0; r < kTileRows; ++r) a = amax_combine(a, abs_bits(to_float(column[r * TC])));
    }
    BlockScale s;
    if constexpr (kTile2d) {
      a = group_amax(a, 32);
      if (lane == 0) warp_amax[warp] = a;
      __syncthreads();
      if (threadIdx.x < kTilesAcross) {
        float t = 0.0f;
        for (int w = 0; w < kBlock / 32; ++w)
          t = amax_combine(t, warp_amax[threadIdx.x * (kBlock / 32) + w]);
        tile_scale[threadIdx.x] = block_scale<T>(t, cfg);
        const int64_t kb = (k0 / kBlock) + threadIdx.x, mb = m0 / kBlock;
        if (kb * kBlock < K) {
          if (out.row_scale)
            out.row_scale[mb * row_blocks + kb] = tile_scale[threadIdx.x].scale_inv;
          if (out.col_scale)
            out.col_scale[kb * col_blocks + mb] = tile_scale[threadIdx.x].scale_inv;
        }
      }
      __syncthreads();
      s = tile_scale[c < TC ? c / kBlock : 0];
    } else {
      s = block_scale<T>(a, cfg);
    }

    if (out.col_data != nullptr && c < TC && k < K) {
      if (!kTile2d) out.col_scale[k * col_blocks + m0 / kBlock] = s.scale_inv;
      for (int r0 = 0; r0 < kTileRows && m0 + r0 < M; r0 += 16) {
        uint32_t codes[4];
#pragma unroll
        for (int i = 0; i < 16; i += 4) {
          codes[i / 4] = fp8x2_code(to_float(column[(r0 + i) * TC]) * s.scale,
                                    to_float(column[(r0 + i + 1) * TC]) * s.scale, cfg.element) |
                         (fp8x2_code(to_float(column[(r0 + i + 2) * TC]) * s.scale,
                                     to_float(column[(r0 + i + 3) * TC]) * s.scale, cfg.element)
                          << 16);
        }
        *reinterpret_cast<uint4*>(out.col_data + k * M + m0 + r0) =
            make_uint4(codes[0], codes[1], codes[2], codes[3]);
      }
    }
  }

  // Rowwise usage, re-read from shared memory: a warp quantizes one tile row per pass, with
  // the 128x128 tile's scale or its 1x128 block's (the zero fill past K leaves it exact).
  if (out.row_data == nullptr) return;
  constexpr int kLanesPerBlock = kBlock / V;
  float row_scale = 0.0f;  // 1x128: the scale of row pass (lane % kRowPasses) of the lane's block
  if constexpr (!kTile2d) {
    float part[kRowPasses];
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) part[p] = chunk_amax(tile[warp + p * kWarps][lane], 1);
    const BlockScale mine =
        block_scale<T>(block_amaxes_across_lanes<kRowPasses, kLanesPerBlock>(part), cfg);
    row_scale = mine.scale;
    const int64_t row = m0 + warp + (lane % kRowPasses) * kWarps;
    const int64_t kb = k0 / kBlock + lane / kLanesPerBlock;
    if (lane % kLanesPerBlock < kRowPasses && row < M && kb * kBlock < K) {
      out.row_scale[row * row_blocks + kb] = mine.scale_inv;
    }
  }
#pragma unroll 4
  for (int p = 0; p < kRowPasses; ++p) {
    const int r = warp + p * kWarps;
    if (m0 + r >= M) break;  // the same for the whole warp
    float scale;
    if constexpr (kTile2d) {
      scale = tile_scale[lane * V / kBlock].scale;
    } else {
      scale = __shfl_sync(0xFFFFFFFFu, row_scale, (lane & ~(kLanesPerBlock - 1)) + p);
    }
    if (col >= K) continue;
    store_row_codes(tile[r][lane], scale, cfg.element, out.row_data + (m0 + r) * K + col);
  }
}

ffi::Error fp8_block_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer /*row_amax*/,
                          ffi::AnyBuffer /*col_amax*/, ffi::AnyBuffer /*seed*/,
                          ffi::RemainingRets rets, CastConfig cfg) {
  int64_t M, K;
  if (!matrix_dims(x, M, K)) return invalid("fp8_block_cast: x must be rank 2");
  // Partial 128-blocks are fine; 16-byte vectors and stores need multiples of 16.
  if (M % 16 || K % 16) return invalid("fp8_block_cast: dims must be multiples of 16");
  const bool tile_2d = cfg.block_rows == kBlock;
  BlockOut out{};
  if (auto err = take_cast_results(rets, cfg, "fp8_block_cast", out); err.failure()) return err;
  if (M == 0 || K == 0) return ffi::Error::Success();
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    constexpr size_t kSmem = kTileRows * 32 * sizeof(Vec16<T>);
    const dim3 grid((M + kTileRows - 1) / kTileRows, (K + kTileCols<T> - 1) / kTileCols<T>);
    auto launch = [&](auto kernel) {
      // Over 48 KiB of dynamic shared memory must be opted into (per function, per device).
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) !=
          cudaSuccess) {
        return cuda_status("fp8_block_cast: shared memory opt-in");
      }
      kernel<<<grid, kThreads, kSmem, stream>>>(reinterpret_cast<const T*>(x.untyped_data()), M, K,
                                                cfg, out);
      return cuda_status("fp8_block_cast");
    };
    return tile_2d ? launch(fp8_block_cast_kernel<T, true>)
                   : launch(fp8_block_cast_kernel<T, false>);
  });
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantFp8BlockCast, jaxquant::fp8_block_cast, jaxquant::cast_binding());

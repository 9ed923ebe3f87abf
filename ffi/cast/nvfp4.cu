// NVFP4 cast, rowwise and columnwise in one pass (NUMERICS.md "NVFP4"): 1-D blocks of 16
// or 16x16 tiles, the random Hadamard transform fused on the columnwise path, stochastic
// rounding, per-token (row-scaled) rowwise global amaxes.
//
// The global amaxes are inputs (the amax kernel, or an upstream op, computed them), so the
// cast reads the input once. Tiles and the work split are tile.cuh's staged cast tiles: a
// rowwise block of 16 spans 16 / kVec consecutive lanes of one row, a columnwise block (16
// rows of one column) 4 consecutive lanes of a warp, 4 rows each. The RHT is applied to
// the tile in shared memory, after the rowwise usage has read the original values.
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

// Two 32 KB tile stages, two CTAs of 512 threads per SM, one tile per strip (tile.cuh): the
// kernel is bound by arithmetic, and three or four stages or longer strips measured slower.
constexpr int kStages = 2;

constexpr int kBlock = 16;
constexpr int kScaleCodes = 128;  // E4M3 scale bytes a block can get: 0 .. 0x7E, 0x7F (NaN)

struct Nvfp4Args {
  const float* row_amax;  // [] or [M] (row_scaled)
  const float* col_amax;  // []
  const uint32_t* seed;   // [2], the JAX key's data
  int32_t row_scaled;
};

struct Nvfp4Out {
  uint8_t* row_data;   // [M, K/2]
  uint8_t* row_scale;  // [M, K/16] or [M/16, K/16]
  uint8_t* col_data;   // [K, M/2]
  uint8_t* col_scale;  // [K, M/16] or [K/16, M/16]
};

// E2M1 codes of f[i] * enc, element i in bits 4i .. 4i+3; with SR, byte i of `bits` is
// element i's random byte. A NaN global amax makes every code 0.
template <int N, bool kSr>
__device__ __forceinline__ uint32_t nvfp4_pack(const float (&f)[N], float enc, bool nan_global,
                                               const uint4& bits) {
  uint32_t biased = 0, signs = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float v = f[i] * enc;
    biased += (kSr ? e2m1_biased_sr(v, random_byte(bits, i)) : e2m1_biased_rne(v)) << (4 * i);
    signs |= (__float_as_uint(v) >> (28 - 4 * i)) & (8u << (4 * i));
  }
  constexpr uint32_t kBias = packed_bias(kSr ? kE2m1SrBias : kE2m1RneBias, N);
  return nan_global ? 0u : (biased - kBias) | signs;
}

// The options that change the kernel's code are template parameters, so each variant
// carries only its own registers.
template <typename T, bool kTile2d, bool kRht, bool kSr>
__global__ __launch_bounds__(kCastThreads, kCastMinBlocks) void nvfp4_cast_kernel(
    const T* __restrict__ x, int64_t M, int64_t K, Nvfp4Args args, Nvfp4Out out) {
  constexpr int V = kVec<T>, kColBlocks = kCastCols<T> / kBlock;
  constexpr int kPassRows = kCastThreads / kChunks;
  // Step 4's encoding multiplier for every scale byte: a table instead of a division per block.
  __shared__ float row_enc[kScaleCodes], col_enc[kScaleCodes];
  // 16x16 tiles: per-warp partial amaxes, then the tile scales of the current tile.
  __shared__ float tile_amax[kCastWarps][kCastRows / kBlock];
  __shared__ uint8_t tile_scale[kCastRows / kBlock][kColBlocks];
  // Per-token: the global scales of the current tile's rows, computed once per row.
  __shared__ Nvfp4Global row_globals[kCastRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const Philox philox{kSr ? args.seed[0] : 0u, kSr ? args.seed[1] : 0u};
  const Nvfp4Global row_global = nvfp4_global(args.row_scaled ? 0.0f : *args.row_amax);
  // 16x16 tiles share the rowwise global amax; the columnwise one may be after RHT.
  const Nvfp4Global col_global = kTile2d ? row_global : nvfp4_global(*args.col_amax);
  static_assert(kCastThreads >= 2 * kScaleCodes, "one table entry per thread");
  if (threadIdx.x < kScaleCodes) {
    row_enc[threadIdx.x] = nvfp4_block_enc(threadIdx.x, row_global);
  } else if (threadIdx.x < 2 * kScaleCodes) {
    col_enc[threadIdx.x - kScaleCodes] = nvfp4_block_enc(threadIdx.x - kScaleCodes, col_global);
  }

  for_each_cast_tile<kStages>(x, M, K, /*strip_shift=*/0, [&](CastTile<T>& tile, TileOrigin o) {
    if (!kTile2d && args.row_scaled) {
      if (threadIdx.x < kCastRows) {
        const int64_t m = o.m0 + threadIdx.x;
        row_globals[threadIdx.x] = nvfp4_global(m < M ? args.row_amax[m] : 0.0f);
      }
      __syncthreads();
    }
    if constexpr (kTile2d) {
      // Tile amax: lane (warp w, l) covers rows 4l .. 4l+3 of chunk column w; 4 lanes make
      // the 16 rows, 16 / kVec warps the 16 columns.
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) a = amax_combine(a, chunk_amax(tile.at(4 * lane + j, warp), 1));
      a = group_amax(a, 4);
      if (lane % 4 == 0) tile_amax[warp][lane / 4] = a;
      __syncthreads();
      constexpr int kWarpsPerBlock = kBlock / V;
      if (threadIdx.x < (kCastRows / kBlock) * kColBlocks) {
        const int rb = threadIdx.x / kColBlocks, cb = threadIdx.x % kColBlocks;
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarpsPerBlock; ++w) {
          t = amax_combine(t, tile_amax[cb * kWarpsPerBlock + w][rb]);
        }
        const uint32_t s = nvfp4_scale_byte(t, row_global);
        tile_scale[rb][cb] = static_cast<uint8_t>(s);
        const int64_t mb = o.m0 / kBlock + rb, kb = o.k0 / kBlock + cb;
        if (mb * kBlock < M && kb * kBlock < K) {
          if (out.row_scale) out.row_scale[mb * (K / kBlock) + kb] = s;
          if (out.col_scale) out.col_scale[kb * (M / kBlock) + mb] = s;
        }
      }
      __syncthreads();
    }

    if (out.row_data != nullptr) {
      constexpr int kLanesPerBlock = kBlock / V;
      const int q = row_pass_chunk();
      const int64_t m_first = o.m0 + row_pass_row(0), k = o.k0 + q * V;
      // Output pointers step by whole rows: one 64-bit add per store.
      uint8_t* data = out.row_data + m_first * (K / 2) + k / 2;
      uint8_t* scale = out.row_scale + m_first * (K / kBlock) + k / kBlock;
      uint4 bits{};
#pragma unroll
      for (int i = 0; i < kCastRowPasses; ++i) {
        const int r = row_pass_row(i);
        const int64_t m = o.m0 + r;
        const Vec16<T> v = tile.at(r, q);
        float f[V];
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = element_float(v, j);
        Nvfp4Global g = row_global;
        uint32_t s;
        float enc;
        if constexpr (kTile2d) {
          s = tile_scale[r / kBlock][q * V / kBlock];
          enc = row_enc[s];
        } else {
          const float a = chunk_amax(v, kLanesPerBlock);  // every lane takes part
          if (args.row_scaled) {
            g = row_globals[r];
            s = nvfp4_scale_byte(a, g);
            enc = nvfp4_block_enc(s, g);
          } else {
            s = nvfp4_scale_byte(a, g);
            enc = row_enc[s];
          }
        }
        if (m < M && k < K) {
          // SR: one Philox call per two passes (pass i+1's row is in range only if pass i's is).
          if (kSr && i % 2 == 0) {
            bits = philox(static_cast<uint32_t>(m), static_cast<uint32_t>(k), 0u, 0u);
          }
          const uint4 mine = i % 2 == 0 ? bits
                             : V == 8 ? make_uint4(bits.z, bits.w, 0u, 0u)
                                      : make_uint4(bits.y, 0u, 0u, 0u);
          const uint32_t packed = nvfp4_pack<V, kSr>(f, enc, g.nan, mine);
          if constexpr (V == 8) {
            *reinterpret_cast<uint32_t*>(data) = packed;
          } else {
            *reinterpret_cast<uint16_t*>(data) = static_cast<uint16_t>(packed);
          }
          if (!kTile2d && q % kLanesPerBlock == 0) *scale = s;
        }
        data += kPassRows * (K / 2);
        scale += kPassRows * (K / kBlock);
      }
    }
    if (out.col_data == nullptr) return;

    if constexpr (kRht) {
      // In place, once the rowwise usage has read the tile: thread c transforms 16-row
      // blocks of tile column c, rounding to the input dtype as NUMERICS.md says.
      __syncthreads();
      constexpr int TC = kCastCols<T>;
      const int c = threadIdx.x % TC;
      for (int b = threadIdx.x / TC; b < kCastRows / kBlock; b += kCastThreads / TC) {
        float f[kBlock];
        T y[kBlock];
#pragma unroll
        for (int i = 0; i < kBlock; ++i) f[i] = to_float(tile.element(kBlock * b + i, c));
        rht16_rounded<T>(f, y);
#pragma unroll
        for (int i = 0; i < kBlock; ++i) tile.element(kBlock * b + i, c) = y[i];
      }
      __syncthreads();
    }

    // Columnwise: lane l holds rows 4l .. 4l+3 and writes their 4 codes (2 bytes) of each
    // transposed row; the 16-row block is lanes 4b .. 4b+3.
    const int64_t k_first = o.k0 + warp * V, m = o.m0 + 4 * lane;
    Vec16<T> c[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = tile.at(4 * lane + j, warp);
    float a[V];
    if constexpr (!kTile2d) column_amaxes(c, 4, a);  // every lane takes part
    if (k_first >= K || m >= M) return;
    uint8_t* data = out.col_data + k_first * (M / 2) + m / 2;
    uint8_t* scale = out.col_scale + k_first * (M / kBlock) + m / kBlock;
    uint4 bits{};
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float f[4] = {element_float(c[0], e), element_float(c[1], e), element_float(c[2], e),
                          element_float(c[3], e)};
      const uint32_t s = kTile2d ? tile_scale[lane / 4][(warp * V + e) / kBlock]
                                 : nvfp4_scale_byte(a[e], col_global);
      // SR: one Philox call gives the 4 random bytes of 4 columns.
      if (kSr && e % 4 == 0) {
        bits = philox(static_cast<uint32_t>(m), static_cast<uint32_t>(k_first + e), 1u, 0u);
      }
      const uint32_t word =
          e % 4 == 0 ? bits.x : e % 4 == 1 ? bits.y : e % 4 == 2 ? bits.z : bits.w;
      const uint32_t packed =
          nvfp4_pack<4, kSr>(f, col_enc[s], col_global.nan, make_uint4(word, 0u, 0u, 0u));
      *reinterpret_cast<uint16_t*>(data) = static_cast<uint16_t>(packed);
      if (!kTile2d && lane % 4 == 0) *scale = s;
      data += M / 2;
      scale += M / kBlock;
    }
  }, NoStripEnd{});
}

}  // namespace

namespace {

ffi::Error nvfp4_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_amax,
                      ffi::AnyBuffer col_amax, ffi::AnyBuffer seed, ffi::RemainingRets rets,
                      KernelConfig cfg) {
  int64_t M, K;
  if (!matrix_dims(x, M, K)) return invalid("nvfp4_cast: x must be rank 2");
  if (M % kBlock || K % kBlock) return invalid("nvfp4_cast: dims must be multiples of 16");
  const bool tile_2d = cfg.block_rows == kBlock;
  if (tile_2d && (cfg.rht || cfg.row_scaled)) return invalid("nvfp4_cast: 16x16 tiles take no RHT or row scales");
  const size_t want_row_amax = cfg.row_scaled ? static_cast<size_t>(M) : 1;
  if (row_amax.element_type() != ffi::DataType::F32 || row_amax.element_count() != want_row_amax ||
      col_amax.element_type() != ffi::DataType::F32 || col_amax.element_count() != 1) {
    return invalid("nvfp4_cast: global amaxes must be float32 of the expected size");
  }
  if (cfg.stochastic_rounding && (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 2)) {
    return invalid("nvfp4_cast: the stochastic-rounding seed must be uint32[2]");
  }
  Nvfp4Out out{};
  size_t next = 0;
  if (cfg.rowwise) {
    auto d = result_ptr<uint8_t>(rets, next++), s = result_ptr<uint8_t>(rets, next++);
    if (!d.has_value() || !s.has_value()) return invalid("nvfp4_cast: missing rowwise results");
    out.row_data = *d;
    out.row_scale = *s;
  }
  if (cfg.columnwise) {
    auto d = result_ptr<uint8_t>(rets, next++), s = result_ptr<uint8_t>(rets, next++);
    if (!d.has_value() || !s.has_value()) return invalid("nvfp4_cast: missing columnwise results");
    out.col_data = *d;
    out.col_scale = *s;
  }
  if (M == 0 || K == 0) return ffi::Error::Success();
  Nvfp4Args args{};
  args.row_amax = reinterpret_cast<const float*>(row_amax.untyped_data());
  args.col_amax = reinterpret_cast<const float*>(col_amax.untyped_data());
  args.seed = reinterpret_cast<const uint32_t*>(seed.untyped_data());
  args.row_scaled = cfg.row_scaled;
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    auto launch = [&](auto kernel) {
      constexpr size_t smem = kCastStageBytes<T, kStages>;
      CastPlan plan{};
      const cudaError_t err = plan_cast<T>(kernel, M, K, smem, /*max_strip_shift=*/0, plan);
      if (err != cudaSuccess) return cuda_error("nvfp4_cast: launch plan", err);
      kernel<<<plan.grid, kCastThreads, smem, stream>>>(xp, M, K, args, out);
      return cuda_status("nvfp4_cast");
    };
    const bool sr = cfg.stochastic_rounding;
    if (tile_2d) {
      return sr ? launch(nvfp4_cast_kernel<T, true, false, true>)
                : launch(nvfp4_cast_kernel<T, true, false, false>);
    }
    if (cfg.rht) {
      return sr ? launch(nvfp4_cast_kernel<T, false, true, true>)
                : launch(nvfp4_cast_kernel<T, false, true, false>);
    }
    return sr ? launch(nvfp4_cast_kernel<T, false, false, true>)
              : launch(nvfp4_cast_kernel<T, false, false, false>);
  });
}

}  // namespace
}  // namespace jaxquant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxquantNvfp4Cast, jaxquant::nvfp4_cast,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attrs<jaxquant::KernelConfig>(),
                              JAXQUANT_CMD_BUFFER_SAFE);

// NVFP4 cast, rowwise and columnwise in one pass (NUMERICS.md "NVFP4"): 1-D blocks of 16
// or 16x16 tiles, the random Hadamard transform fused on the columnwise path, stochastic
// rounding, per-token (row-scaled) rowwise global amaxes.
//
// The global amaxes are inputs (the amax kernel, or an upstream op, computed them), so the
// cast reads the input once. Tiles and the work split are tile.cuh's staged cast tiles: a
// rowwise block of 16 spans 16 / kVec consecutive lanes of one row, a columnwise block (16
// rows of one column) 4 consecutive lanes of a warp, 4 rows each. The RHT is applied to
// the tile in shared memory, after the rowwise usage has read the original values.
//
// The values handler (jaxquant_nvfp4_values) is the same pass writing, instead of codes
// and scales, each usage's block-scaled values in bf16 (E2M1 times its E4M3 block scale,
// exact in bf16; S_dec left out), what a GEMM that dequantizes first multiplies: the
// dequantize kernel's products with `block_scales_only`, bit for bit, with no dequantize
// pass of their own (kernels/_gemm_values.py).
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

// Two 32 KB tile stages, two CTAs of 512 threads per SM: three or four stages measured
// slower.
constexpr int kStages = 2;

constexpr int kBlock = 16;
constexpr int kScaleCodes = 128;  // E4M3 scale bytes a block can get: 0 .. 0x7E, 0x7F (NaN)
// Rowwise scale bytes are staged in shared memory for a strip of tiles along K that gives
// each row 32 bytes, one sector, and stored once the strip is done (tile.cuh). Scale stores
// cost the cast a quarter of its time when each lane stored its byte (16384 x 8192 bf16 on
// an H100: 0.228 ms, 0.176 ms without any scale stores); with the strips, 0.201 ms.
// Staging the columnwise bytes too (a column's 8 bytes in one store) measured no faster.
constexpr int kStripBytes = 32;
template <typename T>
constexpr int kMaxStripShift = sizeof(T) == 4 ? 3 : 2;  // 4 or 8 scale bytes a tile row

struct Nvfp4Args {
  const float* row_amax;  // [] or [M] (kRowScaled)
  const float* col_amax;  // []
  const uint32_t* seed;   // [2], the JAX key's data
};

struct Nvfp4Out {
  uint8_t* row_data;          // [M, K/2]
  uint8_t* row_scale;         // [M, K/16] or [M/16, K/16]
  uint8_t* col_data;          // [K, M/2]
  uint8_t* col_scale;         // [K, M/16] or [K/16, M/16]
  __nv_bfloat16* row_values;  // [M, K], the values kernel's instead of the four above
  __nv_bfloat16* col_values;  // [K, M]
};

// The bf16 values of N packed E2M1 codes (nibble i: element i) in a block of scale byte s:
// the dequantize kernel's block-scales-only products, h * (2^14 s) with h the code times
// 2^-14 (numerics.cuh), both exact, so the same bits.
template <int N>
__device__ __forceinline__ void e2m1_values(uint32_t packed, uint32_t s, __nv_bfloat16* out) {
  const float multiplier = e4m3_to_float(static_cast<uint8_t>(s)) * 16384.0f;
  static_assert(N == 4 || N == 8, "one 8- or 16-byte store");
  uint2 words[N / 4];
  __nv_bfloat16* v = reinterpret_cast<__nv_bfloat16*>(words);
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float2 h = e2m1x2_to_float2_scaled(packed >> (4 * i));
    v[i] = from_float<__nv_bfloat16>(h.x * multiplier);
    v[i + 1] = from_float<__nv_bfloat16>(h.y * multiplier);
  }
  if constexpr (N == 8) {
    *reinterpret_cast<uint4*>(out) = make_uint4(words[0].x, words[0].y, words[1].x, words[1].y);
  } else {
    *reinterpret_cast<uint2*>(out) = words[0];
  }
}

// E2M1 code of v (numerics.cuh) plus its rounding's bias; u is the element's random byte.
template <bool kSr>
__device__ __forceinline__ uint32_t e2m1_biased(float v, uint32_t u) {
  return kSr ? e2m1_biased_sr(v, u) : e2m1_biased_rne(v);
}
template <bool kSr>
constexpr uint32_t kE2m1Bias = kSr ? kE2m1SrBias : kE2m1RneBias;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
}

// Sign bits of the 8 two-byte elements in words w0 .. w3, at the nibble sign positions (bit
// 4n + 3 for nibble n). A code's sign is its input's: enc >= 0, so x * enc keeps x's sign
// bit. Eight sign bits cost 6 instructions this way, against 16 one element at a time:
// a = [w0.lo, w1.lo, w0.hi, w1.hi] and b = the same of w2, w3, each byte replicated from
// its element's sign (prmt's sign mode); kEvenSel picks from (a, b) the bytes of the even
// nibbles, kOddSel those of the odd ones, in nibble order.
template <uint32_t kEvenSel, uint32_t kOddSel>
__device__ __forceinline__ uint32_t nibble_signs(uint32_t w0, uint32_t w1, uint32_t w2,
                                                 uint32_t w3) {
  constexpr uint32_t kSignBytes = 0xFBD9;  // bytes 1, 5, 3, 7, sign-replicated
  const uint32_t a = prmt(w0, w1, kSignBytes), b = prmt(w2, w3, kSignBytes);
  return (prmt(a, b, kEvenSel) & 0x08080808u) | (prmt(a, b, kOddSel) & 0x80808080u);
}
// Rows: nibble n is element n of a chunk (word n / 2, half n % 2), so nibbles 0 .. 7 come
// from bytes a0 a2 a1 a3 b0 b2 b1 b3.
constexpr uint32_t kRowEven = 0x5410, kRowOdd = 0x7632;
// Column pairs: nibble n < 4 is word n's low half, n >= 4 word n - 4's high half, so
// nibbles 0 .. 7 come from bytes a0 a1 b0 b1 a2 a3 b2 b3.
constexpr uint32_t kPairEven = 0x6240, kPairOdd = 0x7351;

// The same one element at a time, for 4-byte inputs: element i's sign to nibble i.
template <int N>
__device__ __forceinline__ uint32_t nibble_signs(const float (&f)[N]) {
  uint32_t signs = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) signs |= (__float_as_uint(f[i]) >> 31) << (4 * i + 3);
  return signs;
}

// The options that change the kernel's code are template parameters, so each variant
// carries only its own registers and branches.
template <typename T, bool kTile2d, bool kRht, bool kSr, bool kRowScaled, bool kValues>
__global__ __launch_bounds__(kCastThreads, kCastMinBlocks) void nvfp4_cast_kernel(
    const T* __restrict__ x, int64_t M, int64_t K, int strip_shift, Nvfp4Args args, Nvfp4Out out) {
  constexpr int V = kVec<T>, kColBlocks = kCastCols<T> / kBlock;
  constexpr bool kWords = sizeof(T) == 2;  // signs by nibble_signs on whole words
  static_assert(!(kTile2d && (kRht || kRowScaled)), "16x16 tiles take no RHT or row scales");
  // Step 4's encoding multiplier for every scale byte: a table instead of a division per block.
  __shared__ float row_enc[kScaleCodes], col_enc[kScaleCodes];
  // 16x16 tiles: per-warp partial amaxes, then the tile scales of the current tile.
  __shared__ float tile_amax[kCastWarps][kCastRows / kBlock];
  __shared__ uint8_t tile_scale[kCastRows / kBlock][kColBlocks];
  // Per-token: the global scales of the current tile's rows, computed once per row.
  __shared__ Nvfp4Global row_globals[kCastRows];
  // 1-D blocks: the rowwise scales of the current strip.
  static_assert(kStripBytes % kColBlocks == 0, "whole tiles per strip");
  __shared__ __align__(16) uint8_t strip_scales[kCastRows][kStripBytes];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const Philox philox{kSr ? args.seed[0] : 0u, kSr ? args.seed[1] : 0u};
  const Nvfp4Global row_global = nvfp4_global(kRowScaled ? 0.0f : *args.row_amax);
  // 16x16 tiles share the rowwise global amax; the columnwise one may be after RHT.
  const Nvfp4Global col_global = kTile2d ? row_global : nvfp4_global(*args.col_amax);
  static_assert(kCastThreads >= 2 * kScaleCodes, "one table entry per thread");
  if (threadIdx.x < kScaleCodes) {
    row_enc[threadIdx.x] = nvfp4_block_enc(threadIdx.x, row_global);
  } else if (threadIdx.x < 2 * kScaleCodes) {
    col_enc[threadIdx.x - kScaleCodes] = nvfp4_block_enc(threadIdx.x - kScaleCodes, col_global);
  }
  // Output row lengths in bytes (M and K are multiples of 16, so the shifts are exact).
  const int64_t row_bytes = K >> 1, row_scale_bytes = K >> 4;
  const int64_t col_bytes = M >> 1, col_scale_bytes = M >> 4;
  const bool rowwise = (kValues ? static_cast<void*>(out.row_values) : out.row_data) != nullptr;
  const bool columnwise = (kValues ? static_cast<void*>(out.col_values) : out.col_data) != nullptr;

  auto store_row_scales = [&](TileOrigin first, int tiles) {
    if (!kTile2d && !kValues && rowwise) {
      store_strip_scales<kBlock>(strip_scales, out.row_scale, M, row_scale_bytes, first,
                                 tiles * kColBlocks);
    }
  };

  for_each_cast_tile<kStages>(
      x, M, K, strip_shift,
      [&](CastTile<T>& tile, TileOrigin o) {
        // Rows of this tile inside the tensor; a chunk is inside K whole (K % 16 == 0).
        const int rows = static_cast<int>(min(M - o.m0, static_cast<int64_t>(kCastRows)));
        if (kRowScaled) {
          if (threadIdx.x < kCastRows) {
            const int r = static_cast<int>(threadIdx.x);
            row_globals[r] = nvfp4_global(r < rows ? args.row_amax[o.m0 + r] : 0.0f);
          }
          __syncthreads();
        }
        if constexpr (kTile2d) {
          // Tile amax: lane (warp w, l) covers rows 4l .. 4l+3 of chunk column w; 4 lanes make
          // the 16 rows, 16 / kVec warps the 16 columns.
          float a = 0.0f;
#pragma unroll
          for (int j = 0; j < 4; ++j)
            a = amax_combine(a, chunk_amax(tile.at(4 * lane + j, warp), 1));
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
            if (!kValues && mb * kBlock < M && kb * kBlock < K) {
              if (out.row_scale) out.row_scale[mb * row_scale_bytes + kb] = s;
              if (out.col_scale) out.col_scale[kb * col_scale_bytes + mb] = s;
            }
          }
          __syncthreads();
        }

        if (rowwise) {
          constexpr int kLanesPerBlock = kBlock / V;
          const int q = row_pass_chunk(), r_first = row_pass_row(0);
          const int64_t k = o.k0 + q * V;
          const bool k_in = k < K;
          // The pass rows are kCastPassRows apart, so they share one swizzle slot (tile.cuh).
          const Vec16<T>* src = &tile.at(r_first, q);
          // Codes count half bytes, values whole elements: each advances by its own row length.
          uint8_t* data =
              kValues ? nullptr : out.row_data + (o.m0 + r_first) * row_bytes + (k >> 1);
          __nv_bfloat16* values = kValues ? out.row_values + (o.m0 + r_first) * K + k : nullptr;
          const int in_strip = static_cast<int>(o.k0 / kCastCols<T>) & ((1 << strip_shift) - 1);
          const int scale_byte = in_strip * kColBlocks + q / kLanesPerBlock;
          uint4 bits{};
#pragma unroll
          for (int i = 0; i < kCastRowPasses; ++i) {
            const int r = r_first + i * kCastPassRows;
            const Vec16<T> v = src[i * kCastPassRows * kChunks];
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
              if constexpr (kRowScaled) {
                g = row_globals[r];
                s = nvfp4_scale_byte(a, g);
                enc = nvfp4_block_enc(s, g);
              } else {
                s = nvfp4_scale_byte(a, g);
                enc = row_enc[s];
              }
              if (!kValues && q % kLanesPerBlock == 0) strip_scales[r][scale_byte] = s;
            }
            if (k_in && r < rows) {
              // SR: one Philox call per two passes (pass i+1's row is in range only if pass i's
              // is).
              if (kSr && i % 2 == 0) {
                bits = philox(static_cast<uint32_t>(o.m0 + r), static_cast<uint32_t>(k), 0u, 0u);
              }
              const uint4 mine = i % 2 == 0 ? bits
                                 : V == 8   ? make_uint4(bits.z, bits.w, 0u, 0u)
                                            : make_uint4(bits.y, 0u, 0u, 0u);
              uint32_t biased = 0;
#pragma unroll
              for (int j = 0; j < V; ++j) {
                biased += e2m1_biased<kSr>(f[j] * enc, random_byte(mine, j)) << (4 * j);
              }
              uint32_t signs;
              if constexpr (kWords) {
                signs = nibble_signs<kRowEven, kRowOdd>(vec_word(v, 0), vec_word(v, 1),
                                                        vec_word(v, 2), vec_word(v, 3));
              } else {
                signs = nibble_signs(f);
              }
              const uint32_t packed =
                  g.nan ? 0u : (biased - packed_bias(kE2m1Bias<kSr>, V)) | signs;
              if constexpr (kValues) {
                e2m1_values<V>(packed, s, values);
              } else if constexpr (V == 8) {
                *reinterpret_cast<uint32_t*>(data) = packed;
              } else {
                *reinterpret_cast<uint16_t*>(data) = static_cast<uint16_t>(packed);
              }
            }
            if constexpr (kValues) {
              values += kCastPassRows * K;
            } else {
              data += kCastPassRows * row_bytes;
            }
          }
        }
        if (!columnwise) return;

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
        // transposed row; the 16-row block is lanes 4b .. 4b+3. Two columns at a time share
        // one packed word (low half column e, high half e + 1).
        const int64_t k_first = o.k0 + warp * V;
        Vec16<T> c[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) c[j] = tile.at(4 * lane + j, warp);
        float a[V];
        if constexpr (!kTile2d) column_amaxes(c, 4, a);  // every lane takes part
        if (k_first >= K || 4 * lane >= rows) return;
        const int64_t m = o.m0 + 4 * lane;
        uint8_t* data = kValues ? nullptr : out.col_data + k_first * col_bytes + (m >> 1);
        uint8_t* scale = kValues ? nullptr : out.col_scale + k_first * col_scale_bytes + (m >> 4);
        __nv_bfloat16* values = kValues ? out.col_values + k_first * M + m : nullptr;
        uint4 bits{};
#pragma unroll
        for (int e = 0; e < V; e += 2) {
          uint32_t s[2], biased = 0;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            s[h] = kTile2d ? tile_scale[lane / 4][(warp * V + e + h) / kBlock]
                           : nvfp4_scale_byte(a[e + h], col_global);
            // SR: one Philox call gives the random words of 4 columns, one per column.
            if (kSr && (e + h) % 4 == 0) {
              bits =
                  philox(static_cast<uint32_t>(m), static_cast<uint32_t>(k_first + e + h), 1u, 0u);
            }
            const uint32_t word = (e + h) % 4 == 0   ? bits.x
                                  : (e + h) % 4 == 1 ? bits.y
                                  : (e + h) % 4 == 2 ? bits.z
                                                     : bits.w;
            const float enc = col_enc[s[h]];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float v = element_float(c[j], e + h) * enc;
              biased += e2m1_biased<kSr>(v, (word >> (8 * j)) & 0xFF) << (16 * h + 4 * j);
            }
          }
          uint32_t signs;
          if constexpr (kWords) {
            signs = nibble_signs<kPairEven, kPairOdd>(vec_word(c[0], e / 2), vec_word(c[1], e / 2),
                                                      vec_word(c[2], e / 2), vec_word(c[3], e / 2));
          } else {
            const float f[8] = {element_float(c[0], e),     element_float(c[1], e),
                                element_float(c[2], e),     element_float(c[3], e),
                                element_float(c[0], e + 1), element_float(c[1], e + 1),
                                element_float(c[2], e + 1), element_float(c[3], e + 1)};
            signs = nibble_signs(f);
          }
          const uint32_t packed =
              col_global.nan ? 0u : (biased - packed_bias(kE2m1Bias<kSr>, 8)) | signs;
          if constexpr (kValues) {
            // Column e's 4 rows, then column e + 1's, each one 8-byte store.
            e2m1_values<4>(packed, s[0], values);
            e2m1_values<4>(packed >> 16, s[1], values + M);
            values += 2 * M;
          } else {
            reinterpret_cast<uint16_t*>(data)[0] = static_cast<uint16_t>(packed);
            reinterpret_cast<uint16_t*>(data + col_bytes)[0] = static_cast<uint16_t>(packed >> 16);
            if (!kTile2d && lane % 4 == 0) {
              scale[0] = s[0];
              scale[col_scale_bytes] = s[1];
            }
            data += 2 * col_bytes;
            scale += 2 * col_scale_bytes;
          }
        }
      },
      store_row_scales);
}

}  // namespace

namespace {

// Checks the operands both handlers share; M and K come back.
ffi::Error check_nvfp4_operands(ffi::AnyBuffer x, ffi::AnyBuffer row_amax, ffi::AnyBuffer col_amax,
                                ffi::AnyBuffer seed, const CastConfig& cfg, const std::string& what,
                                int64_t& M, int64_t& K) {
  if (!matrix_dims(x, M, K)) return invalid(what + ": x must be rank 2");
  if (M % kBlock || K % kBlock) return invalid(what + ": dims must be multiples of 16");
  const bool tile_2d = cfg.block_rows == kBlock;
  if (tile_2d && (cfg.rht || cfg.row_scaled))
    return invalid(what + ": 16x16 tiles take no RHT or row scales");
  const size_t want_row_amax = cfg.row_scaled ? static_cast<size_t>(M) : 1;
  if (row_amax.element_type() != ffi::DataType::F32 || row_amax.element_count() != want_row_amax ||
      col_amax.element_type() != ffi::DataType::F32 || col_amax.element_count() != 1) {
    return invalid(what + ": global amaxes must be float32 of the expected size");
  }
  if (cfg.stochastic_rounding &&
      (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 2)) {
    return invalid(what + ": the stochastic-rounding seed must be uint32[2]");
  }
  return ffi::Error::Success();
}

template <bool kValues>
ffi::Error launch_nvfp4(cudaStream_t stream, ffi::AnyBuffer x, int64_t M, int64_t K,
                        ffi::AnyBuffer row_amax, ffi::AnyBuffer col_amax, ffi::AnyBuffer seed,
                        const CastConfig& cfg, const Nvfp4Out& out, const char* what) {
  Nvfp4Args args{};
  args.row_amax = reinterpret_cast<const float*>(row_amax.untyped_data());
  args.col_amax = reinterpret_cast<const float*>(col_amax.untyped_data());
  args.seed = reinterpret_cast<const uint32_t*>(seed.untyped_data());
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    // 16x16 tiles write their few scale bytes per tile: no strips.
    auto launch = [&](auto kernel, int max_strip_shift = kMaxStripShift<T>) {
      constexpr size_t smem = kCastStageBytes<T, kStages>;
      CastPlan plan{};
      const cudaError_t err = plan_cast<T>(kernel, M, K, smem, max_strip_shift, plan);
      if (err != cudaSuccess) return cuda_error((std::string(what) + ": launch plan").c_str(), err);
      kernel<<<plan.grid, kCastThreads, smem, stream>>>(xp, M, K, plan.strip_shift, args, out);
      return cuda_status(what);
    };
    // kTile2d, kRht, kSr, kRowScaled as template arguments.
    auto variant = [&](auto tile_2d, auto rht) {
      constexpr bool k2d = decltype(tile_2d)::value, kRht = decltype(rht)::value;
      if constexpr (k2d) {
        return cfg.stochastic_rounding
                   ? launch(nvfp4_cast_kernel<T, true, false, true, false, kValues>, 0)
                   : launch(nvfp4_cast_kernel<T, true, false, false, false, kValues>, 0);
      } else if (cfg.row_scaled) {
        return cfg.stochastic_rounding
                   ? launch(nvfp4_cast_kernel<T, false, kRht, true, true, kValues>)
                   : launch(nvfp4_cast_kernel<T, false, kRht, false, true, kValues>);
      } else {
        return cfg.stochastic_rounding
                   ? launch(nvfp4_cast_kernel<T, false, kRht, true, false, kValues>)
                   : launch(nvfp4_cast_kernel<T, false, kRht, false, false, kValues>);
      }
    };
    if (cfg.block_rows == kBlock) return variant(std::true_type{}, std::false_type{});
    return cfg.rht ? variant(std::false_type{}, std::true_type{})
                   : variant(std::false_type{}, std::false_type{});
  });
}

ffi::Error nvfp4_cast(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_amax,
                      ffi::AnyBuffer col_amax, ffi::AnyBuffer seed, ffi::RemainingRets rets,
                      CastConfig cfg) {
  int64_t M, K;
  if (auto err = check_nvfp4_operands(x, row_amax, col_amax, seed, cfg, "nvfp4_cast", M, K);
      err.failure()) {
    return err;
  }
  Nvfp4Out out{};
  if (auto err = take_cast_results(rets, cfg, "nvfp4_cast", out); err.failure()) return err;
  if (M == 0 || K == 0) return ffi::Error::Success();
  return launch_nvfp4<false>(stream, x, M, K, row_amax, col_amax, seed, cfg, out, "nvfp4_cast");
}

// The cast's operands and attributes; results: the rowwise values [M, K] if `rowwise`,
// then the columnwise values [K, M] if `columnwise`, bf16 (kernels/_gemm_values.py).
ffi::Error nvfp4_values(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer row_amax,
                        ffi::AnyBuffer col_amax, ffi::AnyBuffer seed, ffi::RemainingRets rets,
                        CastConfig cfg) {
  int64_t M, K;
  if (auto err = check_nvfp4_operands(x, row_amax, col_amax, seed, cfg, "nvfp4_values", M, K);
      err.failure()) {
    return err;
  }
  Nvfp4Out out{};
  size_t next = 0;
  for (auto [wanted, values] :
       {std::pair{cfg.rowwise, &out.row_values}, std::pair{cfg.columnwise, &out.col_values}}) {
    if (!wanted) continue;
    auto result = result_ptr<__nv_bfloat16>(rets, next++);
    if (!result.has_value()) return invalid("nvfp4_values: missing results");
    *values = *result;
  }
  if (M == 0 || K == 0) return ffi::Error::Success();
  return launch_nvfp4<true>(stream, x, M, K, row_amax, col_amax, seed, cfg, out, "nvfp4_values");
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantNvfp4Cast, jaxquant::nvfp4_cast, jaxquant::cast_binding());
JAXQUANT_DEFINE_HANDLER(JaxquantNvfp4Values, jaxquant::nvfp4_values, jaxquant::cast_binding());

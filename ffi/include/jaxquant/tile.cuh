// Shared pieces of the tile-shaped cast kernels: 16-byte vectors, the staged cast tile,
// NaN-propagating amax, counter-based random bits.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "jaxquant/numerics.cuh"

namespace jaxquant {

// Block size of the one-dimensional kernels (amax, dequantize, block FP8).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVec = 16 / sizeof(T);
// Tile width of the block-FP8 kernel: one warp covers one tile row with one vector per lane.
template <typename T>
constexpr int kTileCols = 32 * kVec<T>;
template <typename T>
struct alignas(16) Vec16 {
  T v[kVec<T>];
};

// CTAs of kThreads for a grid-stride pass over `vectors` 16-byte vectors: enough to fill
// the GPU several times over (132 SMs on an H100), no more; at least one, so that a kernel
// with per-call outputs besides the vectors (a scale) runs on an empty tensor too.
inline int64_t streaming_ctas(int64_t vectors) {
  const int64_t wanted = (vectors + kThreads - 1) / kThreads;
  return wanted < 1 ? 1 : (wanted < 132 * 8 ? wanted : 132 * 8);
}

template <typename T>
__device__ __forceinline__ Vec16<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec16<T>*>(p);
}

template <typename T>
__device__ __forceinline__ Vec16<T> zero_vec() {
  Vec16<T> out;
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) out.v[i] = from_float<T>(0.0f);
  return out;
}

// ---- Staged cast tiles (FP8 per-tensor, MXFP8, NVFP4) -----------------------------------
//
// A cast tile is kCastRows rows x 256 bytes of the input (128 bf16/fp16 or 64 fp32 columns),
// sixteen 16-byte chunks per row. Each CTA walks over the tiles (grid-stride) and copies
// its next tiles into shared memory with cp.async while it casts the current one, so loads
// stay in flight without holding registers.
//
// 256 bytes, not 128: a bf16 tile row then gives 128 bytes of FP8 along the row and a tile
// column 128 bytes of the transposed row, whole cache lines both ways. With 128-byte tiles
// the rowwise stores covered half lines, and a store-only micro-benchmark of that pattern
// reached 0.79 of a copy against 0.89 for whole lines.
//
// Work split inside a tile (16 warps of 32 lanes, kCastThreads):
// - rowwise: thread t reads chunk t % 16 of rows t / 16 + 32 i (i < kCastRowPasses); a row
//   is 16 consecutive lanes, so a block along the row is a group of consecutive lanes;
// - columnwise: warp w reads chunk column w, lane l rows 4l .. 4l+3; for each of its kVec
//   columns a lane holds 4 consecutive elements of one transposed output row, so a warp's
//   store covers 128 consecutive positions of that row.
// Chunk q of row r is stored in slot q ^ ((r / 4) % 8) of the row (the XOR stays inside the
// row's 128-byte half): the 8 lanes that share a 128-byte wavefront then hit 8 distinct
// slots both along a row and down a chunk column.
constexpr int kCastThreads = 512;
constexpr int kCastWarps = kCastThreads / 32;
// Resident CTAs per SM the cast kernels ask the compiler for (caps registers at 64), so that
// two CTAs fit where shared memory allows and one CTA's loads overlap another's work.
constexpr int kCastMinBlocks = 2;
constexpr int kCastRows = 128;
constexpr int kChunks = 16;  // 16-byte chunks per tile row
constexpr int kCastRowPasses = kCastRows * kChunks / kCastThreads;
// Rows between a thread's rowwise passes; a multiple of 32, so that all of a thread's pass
// rows share one swizzle slot (CastTile::slot) and their chunks are constant offsets apart.
constexpr int kCastPassRows = kCastThreads / kChunks;
static_assert(kCastPassRows % 32 == 0, "pass rows share a swizzle slot");
static_assert(kCastWarps == kChunks && kCastRows == 32 * 4,
              "the column split is one warp per chunk column, 4 rows per lane");

template <typename T>
constexpr int kCastCols = kChunks * kVec<T>;

template <typename T>
struct CastTile {
  Vec16<T> chunk[kCastRows][kChunks];

  __device__ __forceinline__ static int slot(int r, int q) { return q ^ ((r >> 2) & 7); }
  __device__ __forceinline__ const Vec16<T>& at(int r, int q) const { return chunk[r][slot(r, q)]; }
  __device__ __forceinline__ T& element(int r, int c) {
    return chunk[r][slot(r, c / kVec<T>)].v[c % kVec<T>];
  }
};

// The stages live in dynamic shared memory (32 KB each: more than the 48 KB of static
// shared memory allows for two).
template <typename T, int kStages>
constexpr size_t kCastStageBytes = sizeof(CastTile<T>) * kStages;

template <typename T>
__device__ __forceinline__ CastTile<T>* cast_stages() {
  extern __shared__ __align__(128) unsigned char cast_smem[];
  return reinterpret_cast<CastTile<T>*>(cast_smem);
}

// Position of a tile in the input and of this thread's rowwise chunk in it.
struct TileOrigin {
  int64_t m0, k0;
};

__device__ __forceinline__ int row_pass_row(int pass) {
  return threadIdx.x / kChunks + pass * kCastPassRows;
}
__device__ __forceinline__ int row_pass_chunk() { return threadIdx.x % kChunks; }

// 16-byte global -> shared copy; an invalid source zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Runs body(tile, origin) (tile writable) for every cast tile of x [M, K] that this CTA
// owns, with kStages shared-memory stages: the CTA's next kStages - 1 tiles load while one
// is cast. body may use __syncthreads (every thread of the CTA runs the same tiles).
//
// Tile order: the tiles are dealt out in strips of 2^strip_shift consecutive tiles along K
// within one 128-row band; CTA c casts strips c, c + grid, ... in order, and after a strip's
// last tile (once every thread is done with it) calls strip_end(origin of its first tile,
// its tile count). A kernel can so collect what a strip writes along K, 4 (MXFP8) or 8
// (NVFP4) block-scale bytes per row and tile, and store it as whole 32-byte sectors
// (store_strip_scales): scattered 4-byte pieces of the rowwise and columnwise scales together
// cost the MXFP8 cast 12 % in a micro-benchmark, the same bytes stored contiguously 4 %; the
// NVFP4 cast's rowwise bytes cost it 12 % (0.228 against 0.201 ms). Strips are numbered down M
// first: with one-tile strips that order measured 0.81 of a copy for the MXFP8 cast against
// 0.78 for bands of 16 tiles down M walked across K.
template <int kStages, typename T, typename Body, typename StripEnd>
__device__ __forceinline__ void for_each_cast_tile(const T* __restrict__ x, int64_t M, int64_t K,
                                                   int strip_shift, Body&& body,
                                                   StripEnd&& strip_end) {
  static_assert(kStages >= 2, "one stage casts while the others load");
  CastTile<T>* stage = cast_stages<T>();
  constexpr int V = kVec<T>;
  // Tile counts fit 32 bits (the handlers check), so the per-tile index math is 32-bit.
  const uint32_t tiles_m = static_cast<uint32_t>((M + kCastRows - 1) / kCastRows);
  const uint32_t tiles_k = static_cast<uint32_t>((K + kCastCols<T> - 1) / kCastCols<T>);
  const uint32_t strip = 1u << strip_shift;
  const uint32_t strips = tiles_m * ((tiles_k + strip - 1) >> strip_shift);
  const uint32_t my_strips =
      blockIdx.x < strips ? (strips - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  if (my_strips == 0) return;  // uniform over the CTA (and no division by tiles_m = 0)
  // The CTA's n-th tile. A strip at the right edge is padded to full length with tiles
  // past K (valid false: loaded and cast by nobody, so every strip has the same length).
  struct Slot {
    TileOrigin o;
    uint32_t in_strip;  // index within its strip
    bool valid, last;   // last: the strip's last valid tile
  };
  auto slot = [&](uint32_t n) {
    const uint32_t u = blockIdx.x + (n >> strip_shift) * gridDim.x;
    const uint32_t j = n & (strip - 1), band = u / tiles_m;
    const uint32_t tm = u - band * tiles_m, tk = (band << strip_shift) + j;
    return Slot{{static_cast<int64_t>(tm) * kCastRows, static_cast<int64_t>(tk) * kCastCols<T>},
                j,
                u < strips && tk < tiles_k,
                j == strip - 1 || tk == tiles_k - 1};
  };
  // Loads: one 64-bit address per tile, stepped by whole passes.
  const int q = row_pass_chunk(), r0 = row_pass_row(0);
  const int64_t pass_stride = kCastPassRows * K;
  auto load = [&](const Slot& t, CastTile<T>& tile) {
    if (t.valid) {
      const int64_t k = t.o.k0 + q * V;
      const int rows = static_cast<int>(min(M - t.o.m0, static_cast<int64_t>(kCastRows)));
      const T* src = x + (t.o.m0 + r0) * K + k;
      Vec16<T>* dst = &tile.chunk[r0][CastTile<T>::slot(r0, q)];
#pragma unroll
      for (int i = 0; i < kCastRowPasses; ++i) {
        const bool valid = k < K && r0 + i * kCastPassRows < rows;
        cp_async16(dst + i * kCastPassRows * kChunks, valid ? src : x, valid);
        src += pass_stride;
      }
    }
    // Always a group (empty for a padding tile or past the last one), so the wait below
    // counts the same.
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  // ahead[j]: the CTA's j-th tile from the current one (registers: constant indices only).
  // Stage s holds the current tile, stage (s + j) % kStages the j-th next.
  Slot ahead[kStages];
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    ahead[j] = slot(j);
    load(ahead[j], stage[j]);
  }
  int s = 0;
  const uint32_t count = my_strips << strip_shift;
  for (uint32_t n = 0; n < count; ++n) {
    ahead[kStages - 1] = slot(n + kStages - 1);
    load(ahead[kStages - 1], stage[s == 0 ? kStages - 1 : s - 1]);
    // All but the kStages - 1 most recent groups are complete: the current tile has landed.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1) : "memory");
    __syncthreads();
    const Slot& t = ahead[0];
    if (t.valid) body(stage[s], t.o);
    __syncthreads();  // stage s is refilled by the next iteration's load
    if (t.valid && t.last) {
      strip_end(TileOrigin{t.o.m0, t.o.k0 - static_cast<int64_t>(t.in_strip) * kCastCols<T>},
                static_cast<int>(t.in_strip) + 1);
    }
    s = s == kStages - 1 ? 0 : s + 1;
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) ahead[j] = ahead[j + 1];
  }
}

// Stores the rowwise scale bytes of a strip, staged in shared memory (staged[r]: row r's
// bytes for the strip's tiles in order), as 4-byte words where the destination allows:
// whole 32-byte sectors of each row instead of a tile's few bytes at a time. `scale` is
// [M, row_bytes], one byte per kBlock columns; the strip starts at `first` and spans
// `blocks` blocks of each row (those past the row's end are not stored).
template <int kBlock, int kStripBytes>
__device__ __forceinline__ void store_strip_scales(const uint8_t (&staged)[kCastRows][kStripBytes],
                                                   uint8_t* scale, int64_t M, int64_t row_bytes,
                                                   TileOrigin first, int blocks) {
  constexpr int kWords = kStripBytes / 4;
  const int64_t b0 = first.k0 / kBlock;
  const int64_t bytes = min(static_cast<int64_t>(blocks), row_bytes - b0);
  for (int i = threadIdx.x; i < kCastRows * kWords; i += blockDim.x) {
    const int r = i / kWords, w = i % kWords;
    const int64_t m = first.m0 + r;
    if (m >= M || 4 * w >= bytes) continue;
    uint8_t* dst = scale + m * row_bytes + b0 + 4 * w;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(&staged[r][4 * w]);
    if (4 * w + 4 <= bytes && reinterpret_cast<uintptr_t>(dst) % 4 == 0) {
      *reinterpret_cast<uint32_t*>(dst) = word;
    } else {
      for (int b = 0; b < 4 && 4 * w + b < bytes; ++b) dst[b] = static_cast<uint8_t>(word >> 8 * b);
    }
  }
}

// A kernel without strip-wide stores.
struct NoStripEnd {
  __device__ void operator()(TileOrigin, int) const {}
};

// Launch shape of a for_each_cast_tile kernel.
struct CastPlan {
  int grid;         // CTAs: every strip, at most as many as fit on the device at once
  int strip_shift;  // log2 of the tiles per strip
};

// Plans a for_each_cast_tile kernel with `smem` bytes of stages over x [M, K] of T, with
// strips of up to 2^max_strip_shift tiles: the longest whose count still keeps the
// resident CTAs 90 % busy over the rounds (long strips on a small input would leave
// CTAs idle). Also lets the kernel have that much dynamic shared memory (an attribute of
// the function, not a stream operation: capture-safe).
template <typename T, typename Kernel>
inline cudaError_t plan_cast(Kernel kernel, int64_t M, int64_t K, size_t smem, int max_strip_shift,
                             CastPlan& plan) {
  const int64_t tiles_m = (M + kCastRows - 1) / kCastRows;
  const int64_t tiles_k = (K + kCastCols<T> - 1) / kCastCols<T>;
  if (tiles_m * tiles_k > (int64_t{1} << 30)) return cudaErrorInvalidValue;  // 32-bit indices
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kCastThreads, smem);
  }
  if (err != cudaSuccess) return err;
  const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
  int shift = max_strip_shift;
  int64_t strips = 0;
  for (;; --shift) {
    strips = tiles_m * ((tiles_k + (int64_t{1} << shift) - 1) >> shift);
    const int64_t rounds = (strips + resident - 1) / resident;
    if (shift == 0 || 10 * strips >= 9 * rounds * resident) break;
  }
  plan.strip_shift = shift;
  plan.grid = static_cast<int>(strips < resident ? strips : resident);
  return cudaSuccess;
}

// max of two magnitudes (non-negative or NaN), NaN-propagating: on the bit patterns of
// non-negative floats the integer order is the float order, and every NaN with a clear
// sign bit is above +inf.
__device__ __forceinline__ float amax_combine(float a, float b) {
  return __uint_as_float(max(__float_as_uint(a), __float_as_uint(b)));
}

__device__ __forceinline__ float abs_bits(float v) {
  return __uint_as_float(__float_as_uint(v) & 0x7FFFFFFFu);
}

// Reduce an amax over the `lanes` consecutive lanes of a group (lanes a power of two).
__device__ __forceinline__ float group_amax(float a, int lanes) {
  for (int off = 1; off < lanes; off <<= 1) {
    a = amax_combine(a, __shfl_xor_sync(0xFFFFFFFFu, a, off));
  }
  return a;
}

// Folds the amaxes `a` of every thread of a CTA of kCtaWarps warps (each thread must call
// this) into the tensor amax at `out`, by an integer atomicMax on the bit pattern of the
// (non-negative or NaN) magnitude. `out` is zeroed on the same stream before the kernel:
// no host synchronisation, safe to capture in a CUDA graph.
template <int kCtaWarps>
__device__ __forceinline__ void publish_cta_amax(float a, float* out) {
  __shared__ float warp_amax[kCtaWarps];
  a = group_amax(a, 32);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_amax[warp] = a;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kCtaWarps; ++w) a = amax_combine(a, warp_amax[w]);
    atomicMax(reinterpret_cast<unsigned int*>(out), __float_as_uint(a));
  }
}

// ---- Amaxes on the raw bits of 2-byte inputs ------------------------------------------
// For bf16 and fp16, x with its sign bit cleared orders like an unsigned integer (NaN above
// inf), and an amax of such values is one of them: two magnitudes per 32-bit word reduce
// with one 16x2 unsigned max and widen to fp32 once per block. fp32 inputs use
// amax_combine. Either way the result is the fp32 amax, NaN-propagating.

__device__ __forceinline__ uint32_t mag2(uint32_t w) { return w & 0x7FFF7FFFu; }

template <typename T>
__device__ __forceinline__ uint32_t vec_word(const Vec16<T>& v, int i) {
  return reinterpret_cast<const uint32_t*>(&v)[i];
}

// Element i of a vector as fp32; a bf16 is the top half of its fp32, so one mask or shift.
template <typename T>
__device__ __forceinline__ float element_float(const Vec16<T>& v, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = vec_word(v, i / 2);
    return __uint_as_float(i % 2 ? w & 0xFFFF0000u : w << 16);
  } else {
    return to_float(v.v[i]);
  }
}

template <typename T>
__device__ __forceinline__ float mag16_to_float(uint32_t h) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  } else {
    return __uint_as_float(h << 16);
  }
}

__device__ __forceinline__ uint32_t group_max2(uint32_t m, int lanes) {
  for (int off = 1; off < lanes; off <<= 1) m = __vmaxu2(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  return m;
}

// Amax of one chunk, reduced over `lanes` consecutive lanes (every lane must take part).
template <typename T>
__device__ __forceinline__ float chunk_amax(const Vec16<T>& v, int lanes) {
  if constexpr (sizeof(T) == 2) {
    uint32_t m = __vmaxu2(__vmaxu2(mag2(vec_word(v, 0)), mag2(vec_word(v, 1))),
                          __vmaxu2(mag2(vec_word(v, 2)), mag2(vec_word(v, 3))));
    m = group_max2(m, lanes);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __uint_as_float(max(m << 16, m & 0xFFFF0000u));  // widened in place: 3 instructions
    } else {
      return mag16_to_float<T>(max(m & 0xFFFFu, m >> 16));
    }
  } else {
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < kVec<T>; ++i) a = amax_combine(a, abs_bits(element_float(v, i)));
    return group_amax(a, lanes);
  }
}

// Amax of each of the kVec columns of 4 stacked chunks, reduced over `lanes` consecutive
// lanes (every lane must take part).
template <typename T>
__device__ __forceinline__ void column_amaxes(const Vec16<T> (&c)[4], int lanes,
                                              float (&a)[kVec<T>]) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t m = __vmaxu2(__vmaxu2(mag2(vec_word(c[0], i)), mag2(vec_word(c[1], i))),
                            __vmaxu2(mag2(vec_word(c[2], i)), mag2(vec_word(c[3], i))));
      m = group_max2(m, lanes);
      a[2 * i] = mag16_to_float<T>(m & 0xFFFFu);
      a[2 * i + 1] = mag16_to_float<T>(m >> 16);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kVec<T>; ++e) {
      float t = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) t = amax_combine(t, abs_bits(element_float(c[j], e)));
      a[e] = group_amax(t, lanes);
    }
  }
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): 128
// random bits per (key, counter). Stateless, so every element's bits depend only on the
// JAX key and the element's position: reproducible per key, independent of the launch.
struct Philox {
  uint32_t key0, key1;

  __device__ __forceinline__ uint4 operator()(uint32_t c0, uint32_t c1, uint32_t c2,
                                              uint32_t c3) const {
    uint32_t k0 = key0, k1 = key1;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
      const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
      const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
      const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
      c0 = n0;
      c1 = lo1;
      c2 = n2;
      c3 = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
  }
};

// The byte `i` (0..15) of 128 random bits.
__device__ __forceinline__ uint32_t random_byte(const uint4& r, int i) {
  const uint32_t word = i < 4 ? r.x : i < 8 ? r.y : i < 12 ? r.z : r.w;
  return (word >> (8 * (i & 3))) & 0xFF;
}

}  // namespace jaxquant

// Shared pieces of the tile-shaped cast kernels: 16-byte vectors, NaN-propagating amax,
// counter-based random bits.
//
// Every cast kernel has the same shape: a CTA of kThreads threads loads a TR x TC tile of
// the input with one 16-byte load per thread per row group (TC = 32 lanes x one vector),
// keeps it in registers for the rowwise usage and in shared memory for the columnwise
// (transposed) usage, and writes each output exactly once.
#pragma once

#include <cstdint>

#include "jaxquant/numerics.cuh"

namespace jaxquant {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Resident CTAs per SM the cast kernels ask the compiler for (caps registers at 64), so that
// one CTA's loads overlap another's compute and stores.
constexpr int kMinBlocks = 4;

// Elements of T in one 16-byte vector.
template <typename T> constexpr int kVec = 16 / sizeof(T);
// Tile width: one warp covers one tile row with one vector per lane.
template <typename T> constexpr int kTileCols = 32 * kVec<T>;
// Tile height of the one-pass casts: 32 rows per column-phase thread (one MXFP8 block, two
// NVFP4 blocks); with fp32 (128-column tiles) two threads share a column, hence 64 rows.
// Short tiles keep registers low, so several CTAs per SM overlap loads with compute.
template <typename T> constexpr int kCastTileRows = 32 * (kThreads / kTileCols<T>);

template <typename T>
struct alignas(16) Vec16 {
  T v[kVec<T>];
};

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
      c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
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

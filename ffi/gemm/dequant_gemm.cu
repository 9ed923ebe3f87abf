// The fused-dequantize GEMM for few rows (decode-like, M <= 32): D = A . B^T, A [M, K] and
// B [N, K] each MXFP8 (E4M3 / E5M2, E8M0 scales per 32) or NVFP4 (E2M1, E4M3 scales per 16,
// 1-D blocks or 16x16 tiles), in any pairing, both in their stored K-major layout.
//
// With few rows the GEMM is a read of B: the codes are read once and turned into bf16 in
// registers (code * block scale, exact in bf16 for NUMERICS.md's formats), then multiplied
// on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation). A dequantize-first GEMM
// writes and re-reads B in bf16: 2-4x the bytes of the codes.
//
// Work split: a CTA of 4 warps owns 128 rows of B, a warp 32 (four n8 MMA tiles), over one
// K range (split-K when N alone gives too few CTAs). Per 128-deep chunk, lane (g, t) of a
// warp holds 32 consecutive k of one row: k = chunk + 32t .. +31, which is one 16-byte
// (E2M1) or two (FP8) loads and one MXFP8 scale block or two NVFP4 ones. MMA step s of the
// chunk gives the lane's fragment slots {2t, 2t+1} the elements 4s, 4s+1 of its range and
// slots {2t+8, 2t+9} the elements 4s+2, 4s+3; A and B use the same assignment, so every
// product pairs the same k. A (re-read by every CTA, so mostly from L2) is decoded once per
// CTA into shared memory; B's codes are decoded just before their MMA. Partial sums go to
// the call's fp32 workspace (a result buffer XLA allocates with the call, sized by
// JaxquantDequantGemmWorkspaceBytes); a second kernel adds the splits
// in order and applies the epilogue, D = sum * (S_dec_A[m] * S_dec_B[n]) (NVFP4's decode
// scale from its global amax, per tensor or per row; 1 for MXFP8), as the reference does.
#include <optional>
#include <type_traits>

#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/numerics.cuh"

namespace jaxquant {
namespace dequant_gemm_detail {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kNTiles = 4;                      // n8 MMA tiles per warp
constexpr int kCtaRows = kWarps * kNTiles * 8;  // rows of B per CTA
constexpr int kLaneK = 32;                      // consecutive k of one row per lane and chunk
constexpr int kChunk = 4 * kLaneK;              // k per chunk: the four lanes of a quad
constexpr int kMaxRows = 32;                    // M limit: two m16 tiles

struct Operand {
  const uint8_t* data;   // K bytes (FP8) or K / 2 (E2M1) per row
  const uint8_t* scale;  // E8M0 or E4M3 bytes, [rows >> scale_row_shift, K / block]
  int64_t rows;
  int32_t scale_row_shift;  // 4 for NVFP4 16x16 tiles, else 0
};

// One lane's 32 elements of one row: codes (E2M1 uses v[0] only) and their scale byte(s).
struct Raw {
  uint4 v[2];
  uint32_t s;
};

__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// One lane's 32 elements of a row of B, read once: streamed past L1.
template <int E>
__device__ __forceinline__ Raw load_lane(const Operand& op, int64_t row, int64_t k0, int64_t k) {
  Raw raw;
  if (row >= op.rows) {  // past the last row: zero codes under a unit scale
    raw.v[0] = raw.v[1] = make_uint4(0, 0, 0, 0);
    raw.s = E == kE2M1 ? 0x3838u : 0x7Fu;
    return raw;
  }
  if constexpr (E == kE2M1) {
    const uint8_t* p = op.data + row * (k / 2) + k0 / 2;
    raw.v[0] = load_streaming(p);
    raw.v[1] = make_uint4(0, 0, 0, 0);
    raw.s = __ldg(reinterpret_cast<const uint16_t*>(
        op.scale + (row >> op.scale_row_shift) * (k / 16) + k0 / 16));
  } else {
    const uint8_t* p = op.data + row * k + k0;
    raw.v[0] = load_streaming(p);
    raw.v[1] = load_streaming(p + 16);
    raw.s = __ldg(op.scale + row * (k / 32) + k0 / 32);
  }
  return raw;
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t splat_bf16(uint32_t bits) { return bits | (bits << 16); }

// The E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bf16, high and low bytes, indexed 0-7:
// byte-permute lookup tables (PRMT picks any of 8 bytes per output byte).
constexpr uint32_t kE2m1HiA = 0x3F3F3F00u, kE2m1HiB = 0x40404040u;
constexpr uint32_t kE2m1LoA = 0xC0800000u, kE2m1LoB = 0xC0804000u;

// Decodes one lane's 32 elements of one row, four at a time: words(s) is elements 4s..4s+3 as
// two bf16 pairs, code * block scale, the A / B fragment registers of MMA step s. Each
// product is exact and so is its bf16 (the formats' values have at most 5 significant bits),
// unless it falls below bf16's normal range, where it rounds as a dequantize-first GEMM's
// bf16 operand would.
template <int E>
struct LaneDecode {
  const uint32_t* v;
  uint32_t mult[2];  // E2M1: its two block scales, as bf16x2 (E4M3 values are exact in bf16)
  float scale;       // FP8: the E8M0 block scale

  __device__ __forceinline__ explicit LaneDecode(const Raw& raw)
      : v(reinterpret_cast<const uint32_t*>(raw.v)) {
    if constexpr (E == kE2M1) {
      // The top half of an E4M3 value's fp32 bits is its bf16 (NaN stays NaN).
      mult[0] = splat_bf16(__float_as_uint(e4m3_to_float(raw.s & 0xFF)) >> 16);
      mult[1] = splat_bf16(__float_as_uint(e4m3_to_float(raw.s >> 8)) >> 16);
    } else {
      scale = e8m0_to_float(static_cast<uint8_t>(raw.s));
    }
  }

  __device__ __forceinline__ uint2 words(int s) const {
    if constexpr (E == kE2M1) {
      // Hopper has no E2M1 conversion: nibbles 4s..4s+3 select table bytes by their
      // magnitudes; their signs (bit 3 of each nibble, moved to a byte's top bit) are
      // replicated by PRMT's sign mode.
      const uint32_t p = v[s / 2], half = s % 2;
      const uint32_t select = (p & 0x77777777u) >> (16 * half);
      const uint32_t hi = __byte_perm(kE2m1HiA, kE2m1HiB, select);
      const uint32_t lo = __byte_perm(kE2m1LoA, kE2m1LoB, select);
      const uint32_t sign0 = __byte_perm(p << 4, p, half ? 0xE0A0 : 0xC080);
      const uint32_t sign1 = __byte_perm(p << 4, p, half ? 0xF0B0 : 0xD090);
      const uint32_t w0 = __byte_perm(lo, hi, 0x5140) | (sign0 & 0x80008000u);
      const uint32_t w1 = __byte_perm(lo, hi, 0x7362) | (sign1 & 0x80008000u);
      const uint32_t m = mult[s / 4];
      return make_uint2(mul_bf16x2(w0, m), mul_bf16x2(w1, m));
    } else {
      // FP8 -> fp16 -> fp32 is exact (NaN and Inf included); times the scale, exact.
      const float2 f0 = fp8x2_to_float2(v[s], E), f1 = fp8x2_to_float2(v[s] >> 16, E);
      return make_uint2(bf16x2_bits(f0.x * scale, f0.y * scale),
                        bf16x2_bits(f1.x * scale, f1.y * scale));
    }
  }
};

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A's chunk in shared memory, decoded once per CTA: for m16 tile i and MMA step s, lane l's
// fragment (a0, a1, a2, a3) is the 16 bytes at [i][s][l], so each lane reads it with one
// conflict-free 16-byte load. Warp w decodes steps 2w and 2w + 1 for every lane position.
template <int E, int kMTiles>
struct AStage {
  static constexpr int kWords = kMTiles * 8 * 32;  // uint4 per chunk
  Raw raw[kMTiles][2];                             // rows g and g + 8: 8 elements each

  __device__ __forceinline__ void load(const Operand& A, int64_t chunk_k0, int64_t k, int g, int t,
                                       int w) {
    const int64_t k0 = chunk_k0 + kLaneK * t + 8 * w;  // the lane's elements 8w .. 8w + 7
#pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = 16 * i + g + 8 * r;
        Raw& out = raw[i][r];
        out.v[0] = out.v[1] = make_uint4(0, 0, 0, 0);
        if (row >= A.rows) {  // past the last row: zero codes under a unit scale
          out.s = E == kE2M1 ? 0x38u : 0x7Fu;
        } else if constexpr (E == kE2M1) {
          out.v[0].x = __ldg(reinterpret_cast<const uint32_t*>(A.data + row * (k / 2) + k0 / 2));
          out.s = __ldg(A.scale + (row >> A.scale_row_shift) * (k / 16) + k0 / 16);
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(A.data + row * k + k0));
          out.v[0].x = v.x;
          out.v[0].y = v.y;
          out.s = __ldg(A.scale + row * (k / 32) + k0 / 32);
        }
      }
    }
  }

  // The loaded elements are the lane's 8w .. 8w+7, i.e. MMA steps 2w and 2w + 1.
  __device__ __forceinline__ void store(uint4* smem, int lane, int w) const {
#pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
      const LaneDecode<E> lo(raw[i][0]), hi(raw[i][1]);
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const uint2 wl = lo.words(q), wh = hi.words(q);
        smem[(i * 8 + 2 * w + q) * 32 + lane] = make_uint4(wl.x, wh.x, wl.y, wh.y);
      }
    }
  }
};

template <int EB>
__device__ __forceinline__ void load_b(Raw (&b)[kNTiles], const Operand& B, int64_t b_row0,
                                       int64_t k0, int64_t k, int g) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) b[j] = load_lane<EB>(B, b_row0 + 8 * j + g, k0, k);
}

// Codes become bf16 just before their MMA step, which keeps few registers live.
template <int EB, int kMTiles>
__device__ __forceinline__ void multiply(float (&acc)[kMTiles][kNTiles][4], const Raw (&b)[kNTiles],
                                         const uint4* a_smem, int lane) {
  const LaneDecode<EB> db[kNTiles] = {LaneDecode<EB>(b[0]), LaneDecode<EB>(b[1]),
                                      LaneDecode<EB>(b[2]), LaneDecode<EB>(b[3])};
  static_assert(kNTiles == 4, "one decoder per n8 tile");
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    // Fragment B: row g at slots {2t, 2t+1} (elements 4s, 4s+1) and {2t+8, 2t+9} (4s+2,
    // 4s+3); fragment A: rows g and g + 8 at the same slots.
    uint2 wb[kNTiles];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) wb[j] = db[j].words(s);
#pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
      const uint4 fa = a_smem[(i * 8 + s) * 32 + lane];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
        mma_bf16(acc[i][j], fa.x, fa.y, fa.z, fa.w, wb[j].x, wb[j].y);
    }
  }
}

template <int EA, int EB, int kMTiles>
__global__ __launch_bounds__(kThreads) void dequant_gemm_kernel(Operand A, Operand B, int64_t k,
                                                                int64_t chunks_per_split,
                                                                float* __restrict__ partial) {
  __shared__ uint4 a_smem[2][AStage<EA, kMTiles>::kWords];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t b_row0 = static_cast<int64_t>(blockIdx.x) * kCtaRows + warp * kNTiles * 8;
  const int64_t first = blockIdx.y * chunks_per_split;
  const int64_t last = min(first + chunks_per_split, k / kChunk);
  float acc[kMTiles][kNTiles][4] = {};
  // B's next chunk and A's next chunk are loading while this one multiplies; A's is then
  // decoded into the other shared buffer, and one barrier per chunk hands it over. (A third
  // register buffer for B, two chunks in flight, was slower: fewer CTAs fit per SM.)
  Raw cur_b[kNTiles], next_b[kNTiles];
  AStage<EA, kMTiles> stage;
  load_b<EB>(cur_b, B, b_row0, first * kChunk + kLaneK * t, k, g);
  stage.load(A, first * kChunk, k, g, t, warp);
  stage.store(a_smem[0], lane, warp);
  __syncthreads();
  for (int64_t c = first; c < last; ++c) {
    const int buf = (c - first) & 1;
    const bool more = c + 1 < last;
    if (more) {
      load_b<EB>(next_b, B, b_row0, (c + 1) * kChunk + kLaneK * t, k, g);
      stage.load(A, (c + 1) * kChunk, k, g, t, warp);
    }
    multiply<EB, kMTiles>(acc, cur_b, a_smem[buf], lane);
    if (more) stage.store(a_smem[buf ^ 1], lane, warp);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) cur_b[j] = next_b[j];
  }
  // Accumulator (i, j): rows 16i + g (+8), columns b_row0 + 8j + 2t (+1).
  float* out = partial + static_cast<int64_t>(blockIdx.y) * A.rows * B.rows;
#pragma unroll
  for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t m = 16 * i + g + (e >= 2 ? 8 : 0), n = b_row0 + 8 * j + 2 * t + (e & 1);
        if (m < A.rows && n < B.rows) out[m * B.rows + n] = acc[i][j][e];
      }
    }
  }
}

// An operand's outer scale: NVFP4's S_dec from its global amax (per tensor or per row), or
// 1 for MXFP8 (whose buffer is an unread scalar).
struct Outer {
  const float* amax;
  bool nvfp4, per_row;

  __device__ __forceinline__ float at(int64_t row) const {
    return nvfp4 ? nvfp4_global(amax[per_row ? row : 0]).s_dec : 1.0f;
  }
};

// D[m, n] = (sum over splits, in order) * (S_dec_A[m] * S_dec_B[n]); grid (N / 256, M).
template <typename TD>
__global__ void reduce_kernel(const float* __restrict__ partial, int splits, int64_t m_rows,
                              int64_t n_rows, Outer a_outer, Outer b_outer, TD* __restrict__ out) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (n >= n_rows) return;
  const int64_t idx = m * n_rows + n;
  float sum = partial[idx];
  for (int s = 1; s < splits; ++s) sum += partial[s * m_rows * n_rows + idx];
  out[idx] = from_float<TD>(sum * (a_outer.at(m) * b_outer.at(n)));
}

struct Problem {
  Operand a, b;
  int64_t k;
};

template <int V>
using Int = std::integral_constant<int, V>;

// Calls f(Int<EA>{}, Int<EB>{}, Int<kMTiles>{}) for the instantiation that runs this
// problem; f(std::nullopt) when an element code is none of E4M3, E5M2, E2M1.
template <typename F>
auto with_kernel(int32_t a_element, int32_t b_element, int64_t m, F&& f) {
  auto rows = [&](auto ea, auto eb) { return m <= 16 ? f(ea, eb, Int<1>{}) : f(ea, eb, Int<2>{}); };
  auto b = [&](auto ea) {
    switch (b_element) {
      case kE4M3:
        return rows(ea, Int<kE4M3>{});
      case kE5M2:
        return rows(ea, Int<kE5M2>{});
      case kE2M1:
        return rows(ea, Int<kE2M1>{});
      default:
        return f(std::nullopt);
    }
  };
  switch (a_element) {
    case kE4M3:
      return b(Int<kE4M3>{});
    case kE5M2:
      return b(Int<kE5M2>{});
    case kE2M1:
      return b(Int<kE2M1>{});
    default:
      return f(std::nullopt);
  }
}

// K is split so that the grid fills the GPU once (resident CTAs, from the occupancy of the
// instantiation); each split writes its own fp32 [M, N] partial sums to the workspace.
struct Splits {
  int64_t count, chunks_each;
};

template <int EA, int EB, int kMTiles>
ffi::ErrorOr<Splits> plan_splits(int64_t n, int64_t k) {
  const int64_t chunks = k / kChunk;
  if (chunks == 0) return Splits{1, 0};  // K = 0: one zeroed partial
  int device = 0, sms = 0, per_sm = 0;
  if (auto e = cuda_error("dequant_gemm: device", cudaGetDevice(&device)); e.failure())
    return ffi::Unexpected(e);
  if (auto e = cuda_error("dequant_gemm: SM count",
                          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      e.failure())
    return ffi::Unexpected(e);
  if (auto e = cuda_error("dequant_gemm: occupancy",
                          cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                              &per_sm, dequant_gemm_kernel<EA, EB, kMTiles>, kThreads, 0));
      e.failure())
    return ffi::Unexpected(e);
  const int64_t ctas = (n + kCtaRows - 1) / kCtaRows;
  const int64_t want =
      std::min<int64_t>(std::max<int64_t>(int64_t{sms} * std::max(per_sm, 1) / ctas, 1), chunks);
  const int64_t chunks_each = (chunks + want - 1) / want;
  return Splits{(chunks + chunks_each - 1) / chunks_each, chunks_each};
}

ffi::ErrorOr<Splits> splits_for(int64_t m, int64_t n, int64_t k, int32_t a_element,
                                int32_t b_element) {
  return with_kernel(a_element, b_element, m, [&](auto... tags) -> ffi::ErrorOr<Splits> {
    if constexpr (sizeof...(tags) == 1) {
      return ffi::Unexpected(invalid("dequant_gemm: elements must be e4m3, e5m2 or e2m1"));
    } else {
      return plan_splits<decltype(tags)::value...>(n, k);
    }
  });
}

int64_t workspace_bytes(int64_t m, int64_t n, const Splits& splits) {
  return splits.count * m * n * static_cast<int64_t>(sizeof(float));
}

// Checks one operand's buffers against [rows, K] of `element` with its block scales.
ffi::Error check_operand(const char* name, const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                         const ffi::AnyBuffer& outer, int32_t element, int32_t scale_row_shift,
                         int64_t& rows, int64_t& k) {
  int64_t cols;
  if (!matrix_dims(data, rows, cols))
    return invalid(std::string("dequant_gemm: ") + name + " must be rank 2");
  const bool fp4 = element == kE2M1;
  k = fp4 ? 2 * cols : cols;
  const int64_t block = fp4 ? 16 : 32;
  const int64_t scale_rows = rows == 0 ? 0 : ((rows - 1) >> scale_row_shift) + 1;
  if (data.size_bytes() != static_cast<size_t>(rows * cols) ||
      scale.size_bytes() != static_cast<size_t>(scale_rows * (k / block)) ||
      outer.element_type() != ffi::DataType::F32 ||
      (outer.element_count() != 1 && outer.element_count() != static_cast<size_t>(rows))) {
    return invalid(std::string("dequant_gemm: ") + name +
                   "'s codes, scales or outer scales have the wrong size");
  }
  return ffi::Error::Success();
}

ffi::Error dequant_gemm(cudaStream_t stream, ffi::AnyBuffer a_data, ffi::AnyBuffer a_scale,
                        ffi::AnyBuffer a_outer, ffi::AnyBuffer b_data, ffi::AnyBuffer b_scale,
                        ffi::AnyBuffer b_outer, ffi::Result<ffi::AnyBuffer> d,
                        ffi::Result<ffi::AnyBuffer> workspace, int32_t a_element, int32_t b_element,
                        int32_t a_scale_row_shift, int32_t b_scale_row_shift) {
  int64_t m, n, ka, kb;
  if (auto e = check_operand("A", a_data, a_scale, a_outer, a_element, a_scale_row_shift, m, ka);
      e.failure())
    return e;
  if (auto e = check_operand("B", b_data, b_scale, b_outer, b_element, b_scale_row_shift, n, kb);
      e.failure())
    return e;
  const auto dd = d->dimensions();
  if (ka != kb || dd.size() != 2 || dd[0] != m || dd[1] != n) {
    return invalid("dequant_gemm: A [M, K], B [N, K] and D [M, N] disagree");
  }
  const int64_t k = ka;
  if (m > kMaxRows || k % kChunk)
    return invalid("dequant_gemm: needs M <= 32 and K a multiple of 128");
  if (m == 0 || n == 0) return ffi::Error::Success();
  const auto splits = splits_for(m, n, k, a_element, b_element);
  if (!splits.has_value()) return splits.error();
  const int64_t needed = workspace_bytes(m, n, *splits);
  const Workspace given{workspace->untyped_data(), workspace->size_bytes()};
  if (auto e = check_workspace("dequant_gemm", given, needed); e.failure()) return e;
  auto* partial = static_cast<float*>(workspace->untyped_data());
  if (splits->chunks_each == 0) {
    if (auto e = cuda_error("dequant_gemm: zero", cudaMemsetAsync(partial, 0, needed, stream));
        e.failure())
      return e;
  } else {
    const Problem p{{static_cast<const uint8_t*>(a_data.untyped_data()),
                     static_cast<const uint8_t*>(a_scale.untyped_data()), m, a_scale_row_shift},
                    {static_cast<const uint8_t*>(b_data.untyped_data()),
                     static_cast<const uint8_t*>(b_scale.untyped_data()), n, b_scale_row_shift},
                    k};
    const dim3 grid(static_cast<unsigned>((n + kCtaRows - 1) / kCtaRows),
                    static_cast<unsigned>(splits->count));
    with_kernel(a_element, b_element, m, [&](auto... tags) {
      if constexpr (sizeof...(tags) == 3) {  // (splits_for refused unknown elements)
        dequant_gemm_kernel<decltype(tags)::value...>
            <<<grid, kThreads, 0, stream>>>(p.a, p.b, p.k, splits->chunks_each, partial);
      }
      return 0;
    });
    if (auto e = cuda_status("dequant_gemm"); e.failure()) return e;
  }
  const dim3 grid(static_cast<unsigned>((n + 255) / 256), static_cast<unsigned>(m));
  const Outer ao{static_cast<const float*>(a_outer.untyped_data()), a_element == kE2M1,
                 a_outer.element_count() == static_cast<size_t>(m) && m > 1};
  const Outer bo{static_cast<const float*>(b_outer.untyped_data()), b_element == kE2M1,
                 b_outer.element_count() == static_cast<size_t>(n) && n > 1};
  const int count = static_cast<int>(splits->count);
  switch (d->element_type()) {
    case ffi::DataType::BF16:
      reduce_kernel<<<grid, 256, 0, stream>>>(partial, count, m, n, ao, bo,
                                              static_cast<__nv_bfloat16*>(d->untyped_data()));
      break;
    case ffi::DataType::F32:
      reduce_kernel<<<grid, 256, 0, stream>>>(partial, count, m, n, ao, bo,
                                              static_cast<float*>(d->untyped_data()));
      break;
    default:
      return invalid("dequant_gemm: the output dtype must be bfloat16 or float32");
  }
  return cuda_status("dequant_gemm reduce");
}

}  // namespace
}  // namespace dequant_gemm_detail
}  // namespace jaxquant

int64_t JaxquantDequantGemmWorkspaceBytes(int64_t m, int64_t n, int64_t k, int32_t a_element,
                                          int32_t b_element) {
  using namespace jaxquant::dequant_gemm_detail;
  if (m <= 0 || n <= 0 || k < 0) return 0;  // the handler returns before touching its workspace
  const auto splits = splits_for(m, n, k, a_element, b_element);
  return splits.has_value() ? workspace_bytes(m, n, *splits) : -1;
}

JAXQUANT_DEFINE_HANDLER(JaxquantDequantGemm, jaxquant::dequant_gemm_detail::dequant_gemm,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::AnyBuffer>()  // A codes
                            .Arg<xla::ffi::AnyBuffer>()  // A block scales
                            .Arg<xla::ffi::AnyBuffer>()  // A's NVFP4 global amax: [] or [M]
                            .Arg<xla::ffi::AnyBuffer>()  // B codes
                            .Arg<xla::ffi::AnyBuffer>()  // B block scales
                            .Arg<xla::ffi::AnyBuffer>()  // B's NVFP4 global amax: [] or [N]
                            .Ret<xla::ffi::AnyBuffer>()  // D
                            .Ret<xla::ffi::AnyBuffer>()  // workspace: fp32 partial sums
                            .Attr<int32_t>("a_element")
                            .Attr<int32_t>("b_element")
                            .Attr<int32_t>("a_scale_row_shift")
                            .Attr<int32_t>("b_scale_row_shift"));

// NVFP4 cast, rowwise and columnwise in one pass (NUMERICS.md "NVFP4"): 1-D blocks of 16
// or 16x16 tiles, the random Hadamard transform fused on the columnwise path, stochastic
// rounding, per-token (row-scaled) rowwise global amaxes.
//
// The global amaxes are inputs (the amax kernel, or an upstream op, computed them), so the
// cast reads the input once. Tile: 64 rows x (32 lanes x one 16-byte vector) columns.
// Columnwise blocks (16 rows of one column) are handled by one thread from shared memory;
// with 16x16 tiles the column phase also computes the tile scales that the row phase reads.
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

template <typename T> constexpr int kTileRows = kCastTileRows<T>;
constexpr int kBlock = 16;

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

// Codes of one block (or a run of a row inside one) given its encoding multiplier.
template <int N>
__device__ __forceinline__ void nvfp4_codes(const float (&f)[N], float enc, bool nan_global,
                                            bool sr, const uint4& bits, uint32_t (&code)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float v = f[i] * enc;
    code[i] = nan_global ? 0u : sr ? e2m1_code_sr(v, random_byte(bits, i)) : e2m1_code_rne(v);
  }
}

// One rowwise row-vector: a lane's kVec elements of one row (a block spans 16 / kVec lanes).
template <typename T, bool kTile2d, bool kSr>
__device__ __forceinline__ void nvfp4_row_vector(const Vec16<T>& w, int64_t row, int64_t col,
                                                 int64_t M, int64_t K, int lane,
                                                 const Nvfp4Global& tensor_global,
                                                 uint32_t tile_scale, const Nvfp4Args& args,
                                                 const Philox& philox, const Nvfp4Out& out) {
  constexpr int V = kVec<T>, kLanesPerBlock = kBlock / V;
  const bool in_range = row < M && col < K;
  const Nvfp4Global g = args.row_scaled ? nvfp4_global(row < M ? args.row_amax[row] : 0.0f)
                                        : tensor_global;
  float f[V];
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    f[i] = to_float(w.v[i]);
    a = amax_combine(a, abs_bits(f[i]));
  }
  uint32_t s = tile_scale;
  if constexpr (!kTile2d) {
    a = group_amax(a, kLanesPerBlock);  // every lane takes part, in range or not
    s = nvfp4_scale_byte(a, g);
  }
  if (!in_range) return;
  uint4 bits{};
  if constexpr (kSr) {
    const uint64_t counter = static_cast<uint64_t>(row) * K + col;
    bits = philox(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u);
  }
  uint32_t code[V];
  nvfp4_codes(f, nvfp4_block_enc(s, g), g.nan, kSr, bits, code);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) packed |= code[i] << (4 * i);
  uint8_t* dst = out.row_data + row * (K / 2) + col / 2;
  if constexpr (V == 8) {
    *reinterpret_cast<uint32_t*>(dst) = packed;
  } else {
    *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(packed);
  }
  if (!kTile2d && lane % kLanesPerBlock == 0) out.row_scale[row * (K / kBlock) + col / kBlock] = s;
}

// The options that change the kernel's code are template parameters, so each variant
// carries only its own registers (the fused RHT is 16 adds per element).
template <typename T, bool kTile2d, bool kRht, bool kSr>
__global__ __launch_bounds__(kThreads, kMinBlocks) void nvfp4_cast_kernel(const T* __restrict__ x,
                                                              int64_t M, int64_t K,
                                                              Nvfp4Args args, Nvfp4Out out) {
  constexpr int V = kVec<T>, TC = kTileCols<T>, kRowPasses = kTileRows<T> / kWarps;
  __shared__ Vec16<T> tile[kTileRows<T>][32];
  __shared__ uint8_t tile_scale[kTileRows<T> / kBlock][TC / kBlock];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kTileRows<T>;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * TC;
  const int64_t col = k0 + lane * V;
  const Philox philox{kSr ? args.seed[0] : 0u, kSr ? args.seed[1] : 0u};
  const Nvfp4Global row_global = nvfp4_global(args.row_scaled ? 0.0f : *args.row_amax);

  Vec16<T> v[kRowPasses];
#pragma unroll
  for (int p = 0; p < kRowPasses; ++p) {
    const int64_t row = m0 + warp + p * kWarps;
    v[p] = (row < M && col < K) ? load_vec(x + row * K + col) : zero_vec<T>();
  }

  const bool column_phase = out.col_data != nullptr || kTile2d;
  if (column_phase) {
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) tile[warp + p * kWarps][lane] = v[p];
  }
  // 1-D blocks: the rowwise usage straight from registers, before the column phase, so
  // the registers are free again for it.
  if (!kTile2d && out.row_data != nullptr) {
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
      nvfp4_row_vector<T, false, kSr>(v[p], m0 + warp + p * kWarps, col, M, K, lane, row_global,
                                      0u, args, philox, out);
    }
  }
  if (!column_phase) return;
  __syncthreads();

  constexpr int kParts = kThreads / TC, kRowsPerPart = kTileRows<T> / kParts;
  const int c = threadIdx.x % TC, part = threadIdx.x / TC;
  const int64_t k = k0 + c;
  const T* column = reinterpret_cast<const T*>(&tile[0][0]) + c;
  // 16x16 tiles share the rowwise global amax; the columnwise one may be after RHT.
  const Nvfp4Global g = kTile2d ? row_global : nvfp4_global(*args.col_amax);
#pragma unroll
  for (int b = 0; b < kRowsPerPart / kBlock; ++b) {
    const int r0 = part * kRowsPerPart + b * kBlock;
    const int64_t m = m0 + r0;
    float f[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) f[i] = to_float(column[(r0 + i) * TC]);
    if constexpr (kRht) {
      float y[kBlock];
      rht16<T>(f, y);
#pragma unroll
      for (int i = 0; i < kBlock; ++i) f[i] = y[i];
    }
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) a = amax_combine(a, abs_bits(f[i]));
    // Out-of-range columns hold zeros and still take part in the tile shuffle.
    if constexpr (kTile2d) a = group_amax(a, kBlock);
    const uint32_t s = nvfp4_scale_byte(a, g);
    const bool in_range = k < K && m < M;
    if (kTile2d && c % kBlock == 0) {
      tile_scale[r0 / kBlock][c / kBlock] = static_cast<uint8_t>(s);
      if (in_range && out.row_scale) out.row_scale[(m / kBlock) * (K / kBlock) + k / kBlock] = s;
      if (in_range && out.col_scale) out.col_scale[(k / kBlock) * (M / kBlock) + m / kBlock] = s;
    }
    if (out.col_data == nullptr || !in_range) continue;
    uint4 bits{};
    if constexpr (kSr) {
      const uint64_t counter = static_cast<uint64_t>(k) * M + m;
      bits = philox(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 1u, 0u);
    }
    uint32_t code[kBlock];
    nvfp4_codes(f, nvfp4_block_enc(s, g), g.nan, kSr, bits, code);
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < kBlock; ++i) packed[i / 8] |= code[i] << (4 * (i % 8));
    *reinterpret_cast<uint2*>(out.col_data + k * (M / 2) + m / 2) = make_uint2(packed[0], packed[1]);
    if (!kTile2d) out.col_scale[k * (M / kBlock) + m / kBlock] = s;
  }

  // 16x16 tiles: the rowwise usage once the tile scales exist, re-read from shared memory.
  if (kTile2d && out.row_data != nullptr) {
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kRowPasses; ++p) {
      const int r = warp + p * kWarps;
      nvfp4_row_vector<T, true, kSr>(tile[r][lane], m0 + r, col, M, K, lane, row_global,
                                     tile_scale[r / kBlock][lane * V / kBlock], args, philox, out);
    }
  }
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
  if (seed.element_type() != ffi::DataType::U32 || seed.element_count() != 2) {
    return invalid("nvfp4_cast: seed must be uint32[2]");
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
    const dim3 grid((M + kTileRows<T> - 1) / kTileRows<T>, (K + kTileCols<T> - 1) / kTileCols<T>);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    auto launch = [&](auto kernel) {
      kernel<<<grid, kThreads, 0, stream>>>(xp, M, K, args, out);
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
                                  .Attrs<jaxquant::KernelConfig>());

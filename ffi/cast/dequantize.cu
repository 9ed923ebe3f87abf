// Dequantize one usage in its stored layout, every family: data [rows, cols] (cols/2 bytes
// for packed E2M1) and its scales back to the high-precision dtype of the output buffer.
// Each thread turns 8 consecutive elements of one stored row, one 8-byte (E2M1: 4-byte)
// load within one scaling block (blocks are at least 16 wide and 16-aligned), into one
// 16-byte store of bf16/fp16 (two of fp32). Codes are widened through fp16, which holds
// every FP8 and E2M1 value exactly, so each output is the same one or two fp32 products
// as the reference.
// With `block_scales_only` the NVFP4 outer scale S_dec is left out: the values a GEMM
// multiplies (E2M1 times an E4M3 scale: exact in bf16), S_dec applied after the sum.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {

// Mirror of jaxquant.kernels._dequantize.DequantizeConfig, decoded from the FFI attributes
// of the same names: the stored usage's format (the output buffer's dtype says the rest).
struct DequantizeConfig {
  int32_t family;      // Family
  int32_t element;     // Element
  int32_t block_rows;  // scaling block in the stored layout
  int32_t block_cols;
  int32_t row_scaled;         // NVFP4 per-token: one global amax per stored row
  int32_t block_scales_only;  // leave the outer scale (NVFP4's S_dec) out
};

namespace {

struct DequantArgs {
  const uint8_t* data;
  const void* scale;  // fp32 (FP8 families), E8M0 or E4M3 bytes
  const float* amax;  // NVFP4 global amax: [] or [rows]
  int64_t rows, cols;
  int32_t row_shift, col_shift, row_scaled;  // block = 2^shift
  int32_t block_scales_only;
};

// Family and element are template parameters: a thread makes one load, one short chain of
// conversions and one or two stores, so every instruction lengthens the time its load
// waits to be replaced (a runtime-generic version ran at half the copy's bandwidth).
constexpr int kGroup = 8;  // elements a thread: 8 FP8 or 4 E2M1 code bytes, 16 bytes of bf16

// Scale multiplier of the block holding (r, c) in the stored layout (NVFP4: times 2^14,
// see below).
template <int32_t kFamily>
__device__ __forceinline__ float block_multiplier(const DequantArgs& a, int64_t r, int64_t c) {
  if constexpr (kFamily == kFp8Tensor) {
    return *reinterpret_cast<const float*>(a.scale);
  } else {
    // Block FP8 allows a partial last block: ceil(cols / block) blocks per row.
    const int64_t blocks_across = ((a.cols - 1) >> a.col_shift) + 1;
    const int64_t index = (r >> a.row_shift) * blocks_across + (c >> a.col_shift);
    if constexpr (kFamily == kFp8Block) return reinterpret_cast<const float*>(a.scale)[index];
    const uint8_t byte = reinterpret_cast<const uint8_t*>(a.scale)[index];
    if constexpr (kFamily == kMxfp8) return e8m0_to_float(byte);
    return e4m3_to_float(byte) * 16384.0f;
  }
}

template <typename T, int32_t kFamily, int32_t kElement>
__global__ __launch_bounds__(kThreads) void dequantize_kernel(DequantArgs a, T* __restrict__ out) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kGroup;
  if (c >= a.cols) return;
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    float vals[kGroup];
    const float s = block_multiplier<kFamily>(a, r, c);
    if constexpr (kFamily == kNvfp4) {
      // x = q * float(s) * S_dec, in that order (NUMERICS.md NVFP4 step 6); q is 2^14 h
      // exactly, so q * s = h * (2^14 s), both products exact-rounded once. Block scales
      // only: the first product alone.
      const uint32_t packed = *reinterpret_cast<const uint32_t*>(a.data + r * (a.cols / 2) + c / 2);
#pragma unroll
      for (int i = 0; i < kGroup; i += 2) {
        const float2 h = e2m1x2_to_float2_scaled(packed >> (4 * i));
        vals[i] = h.x * s;
        vals[i + 1] = h.y * s;
      }
      if (!a.block_scales_only) {
        const float s_dec = nvfp4_global(a.amax[a.row_scaled ? r : 0]).s_dec;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) vals[i] *= s_dec;
      }
    } else {
      const uint2 packed = *reinterpret_cast<const uint2*>(a.data + r * a.cols + c);
      const uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
      for (int i = 0; i < kGroup; i += 2) {
        const float2 q = fp8x2_to_float2(words[i / 4] >> (8 * (i % 4)), kElement);
        vals[i] = q.x * s;
        vals[i + 1] = q.y * s;
      }
    }
    constexpr int V = kVec<T>;
    Vec16<T>* dst = reinterpret_cast<Vec16<T>*>(out + r * a.cols + c);
#pragma unroll
    for (int j = 0; j < kGroup / V; ++j) {
      Vec16<T> w;
#pragma unroll
      for (int i = 0; i < V; ++i) w.v[i] = from_float<T>(vals[j * V + i]);
      dst[j] = w;
    }
  }
}

template <typename T, int32_t kFamily, int32_t kElement>
void launch(const DequantArgs& a, T* out, cudaStream_t stream) {
  constexpr int64_t kMaxGridY = 65535;
  const dim3 grid((a.cols / kGroup + kThreads - 1) / kThreads,
                  a.rows < kMaxGridY ? a.rows : kMaxGridY);
  dequantize_kernel<T, kFamily, kElement><<<grid, kThreads, 0, stream>>>(a, out);
}

// An FP8 family's kernel for the element type.
template <typename T, int32_t kFamily>
void launch_fp8(const DequantArgs& a, T* out, bool e5m2, cudaStream_t stream) {
  if (e5m2) {
    launch<T, kFamily, kE5M2>(a, out, stream);
  } else {
    launch<T, kFamily, kE4M3>(a, out, stream);
  }
}

// log2 of a power-of-two block size, or -1.
int block_shift(int32_t size) {
  if (size <= 0 || (size & (size - 1))) return -1;
  int shift = 0;
  while ((1 << shift) < size) ++shift;
  return shift;
}

ffi::Error dequantize(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                      ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> result,
                      DequantizeConfig cfg) {
  int64_t rows, cols;
  if (!matrix_dims(*result, rows, cols)) return invalid("dequantize: output must be rank 2");
  if (cols % 16) return invalid("dequantize: cols must be a multiple of 16");
  const bool nvfp4 = cfg.family == kNvfp4;
  if (data.size_bytes() != static_cast<size_t>(rows * (nvfp4 ? cols / 2 : cols))) {
    return invalid("dequantize: data size does not match the output shape");
  }
  const size_t amax_count = cfg.row_scaled ? static_cast<size_t>(rows) : 1;
  if (nvfp4 && !cfg.block_scales_only && amax.element_count() != amax_count) {
    return invalid("dequantize: NVFP4 global amax has the wrong size");
  }
  DequantArgs a{};
  a.data = reinterpret_cast<const uint8_t*>(data.untyped_data());
  a.scale = scale.untyped_data();
  a.amax = reinterpret_cast<const float*>(amax.untyped_data());
  a.rows = rows;
  a.cols = cols;
  a.row_shift = cfg.family == kFp8Tensor ? 0 : block_shift(cfg.block_rows);
  a.col_shift = cfg.family == kFp8Tensor ? 0 : block_shift(cfg.block_cols);
  if (a.row_shift < 0 || a.col_shift < 0) {
    return invalid("dequantize: block dims must be powers of two");
  }
  a.row_scaled = cfg.row_scaled;
  a.block_scales_only = cfg.block_scales_only;
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  return dispatch_float(result->element_type(), [&](auto tag) {
    using T = decltype(tag);
    T* out = reinterpret_cast<T*>(result->untyped_data());
    const bool e5m2 = cfg.element == kE5M2;
    switch (cfg.family) {
      case kFp8Tensor:
        launch_fp8<T, kFp8Tensor>(a, out, e5m2, stream);
        break;
      case kFp8Block:
        launch_fp8<T, kFp8Block>(a, out, e5m2, stream);
        break;
      case kMxfp8:
        launch_fp8<T, kMxfp8>(a, out, e5m2, stream);
        break;
      case kNvfp4:
        launch<T, kNvfp4, kE2M1>(a, out, stream);
        break;
      default:
        return invalid("dequantize: unknown family " + std::to_string(cfg.family));
    }
    return cuda_status("dequantize");
  });
}

}  // namespace
}  // namespace jaxquant

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jaxquant::DequantizeConfig,
                                      ::xla::ffi::StructMember<int32_t>("family"),
                                      ::xla::ffi::StructMember<int32_t>("element"),
                                      ::xla::ffi::StructMember<int32_t>("block_rows"),
                                      ::xla::ffi::StructMember<int32_t>("block_cols"),
                                      ::xla::ffi::StructMember<int32_t>("row_scaled"),
                                      ::xla::ffi::StructMember<int32_t>("block_scales_only"));

JAXQUANT_DEFINE_HANDLER(JaxquantDequantize, jaxquant::dequantize,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::AnyBuffer>()  // data
                            .Arg<xla::ffi::AnyBuffer>()  // scales
                            .Arg<xla::ffi::AnyBuffer>()  // NVFP4's global amax: [] or [rows]
                            .Ret<xla::ffi::AnyBuffer>()
                            .Attrs<jaxquant::DequantizeConfig>());

// Dequantize one usage in its stored layout, every family: data [rows, cols] (cols/2 bytes
// for packed E2M1) and its scales back to the high-precision dtype of the output buffer.
// Each thread turns 16 consecutive elements of one stored row into 16 outputs.
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {
namespace {

struct DequantArgs {
  const uint8_t* data;
  const void* scale;     // fp32 (FP8 families), E8M0 or E4M3 bytes
  const float* amax;     // NVFP4 global amax: [] or [rows]
  int64_t rows, cols;
  int32_t family, element, block_rows, block_cols, row_scaled;
};

// Scale multiplier of the block holding (r, c) in the stored layout.
__device__ __forceinline__ float block_multiplier(const DequantArgs& a, int64_t r, int64_t c) {
  if (a.family == kFp8Tensor) return *reinterpret_cast<const float*>(a.scale);
  const int64_t blocks_across = (a.cols + a.block_cols - 1) / a.block_cols;
  const int64_t index = (r / a.block_rows) * blocks_across + c / a.block_cols;
  if (a.family == kFp8Block) return reinterpret_cast<const float*>(a.scale)[index];
  const uint8_t byte = reinterpret_cast<const uint8_t*>(a.scale)[index];
  if (a.family == kMxfp8) return e8m0_to_float(byte);
  return e4m3_to_float(byte);
}

template <typename T>
__global__ __launch_bounds__(kThreads) void dequantize_kernel(DequantArgs a, T* __restrict__ out) {
  const int64_t groups_per_row = a.cols / 16;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (g >= a.rows * groups_per_row) return;
  const int64_t r = g / groups_per_row, c = (g % groups_per_row) * 16;
  float vals[16];
  if (a.family == kNvfp4) {
    // x = q * float(s) * S_dec, in that order (NUMERICS.md NVFP4 step 6).
    const uint2 packed = *reinterpret_cast<const uint2*>(a.data + r * (a.cols / 2) + c / 2);
    const float s = block_multiplier(a, r, c);
    const float s_dec = nvfp4_global(a.row_scaled ? a.amax[r] : *a.amax).s_dec;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t word = i < 8 ? packed.x : packed.y;
      vals[i] = e2m1_to_float((word >> (4 * (i % 8))) & 0xF) * s * s_dec;
    }
  } else {
    const uint4 packed = *reinterpret_cast<const uint4*>(a.data + r * a.cols + c);
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    // Blocks are at least 16 wide and 16-aligned, so one multiplier serves all 16.
    const float s = block_multiplier(a, r, c);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint8_t code = (words[i / 4] >> (8 * (i % 4))) & 0xFF;
      vals[i] = fp8_to_float(code, a.element) * s;
    }
  }
  constexpr int V = kVec<T>;
  Vec16<T>* dst = reinterpret_cast<Vec16<T>*>(out + r * a.cols + c);
#pragma unroll
  for (int j = 0; j < 16 / V; ++j) {
    Vec16<T> w;
#pragma unroll
    for (int i = 0; i < V; ++i) w.v[i] = from_float<T>(vals[j * V + i]);
    dst[j] = w;
  }
}

ffi::Error dequantize(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                      ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> result, KernelConfig cfg) {
  int64_t rows, cols;
  if (!matrix_dims(*result, rows, cols)) return invalid("dequantize: output must be rank 2");
  if (cols % 16) return invalid("dequantize: cols must be a multiple of 16");
  const bool nvfp4 = cfg.family == kNvfp4;
  if (data.size_bytes() != static_cast<size_t>(rows * (nvfp4 ? cols / 2 : cols))) {
    return invalid("dequantize: data size does not match the output shape");
  }
  if (nvfp4 && amax.element_count() != (cfg.row_scaled ? static_cast<size_t>(rows) : 1)) {
    return invalid("dequantize: NVFP4 global amax has the wrong size");
  }
  DequantArgs a{};
  a.data = reinterpret_cast<const uint8_t*>(data.untyped_data());
  a.scale = scale.untyped_data();
  a.amax = reinterpret_cast<const float*>(amax.untyped_data());
  a.rows = rows;
  a.cols = cols;
  a.family = cfg.family;
  a.element = cfg.element;
  a.block_rows = cfg.block_rows > 0 ? cfg.block_rows : 1;
  a.block_cols = cfg.block_cols > 0 ? cfg.block_cols : 1;
  a.row_scaled = cfg.row_scaled;
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  return dispatch_float(result->element_type(), [&](auto tag) {
    using T = decltype(tag);
    const int64_t groups = rows * (cols / 16);
    dequantize_kernel<T><<<(groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        a, reinterpret_cast<T*>(result->untyped_data()));
    return cuda_status("dequantize");
  });
}

}  // namespace
}  // namespace jaxquant

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxquantDequantize, jaxquant::dequantize,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attrs<jaxquant::KernelConfig>());

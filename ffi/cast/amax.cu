// amax kernels (NUMERICS.md: max |x| in fp32, NaN propagates): per tensor, per row, and
// per tensor of the Hadamard-transformed columnwise data (NVFP4 with RHT takes its
// columnwise global amax after the transform).
//
// Per-tensor results combine across CTAs (tile.cuh's publish_cta_amax) into an output
// zeroed on the same stream.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/tile.cuh"

namespace jaxquant {

// Mirror of jaxquant.kernels._amax.AmaxConfig, decoded from the FFI attributes of the same
// names: which amax (the RHT one is per tensor; Python refuses both).
struct AmaxConfig {
  int32_t per_row;  // per row instead of per tensor
  int32_t rht;      // of the Hadamard-transformed columnwise data
};

namespace {

template <typename T>
__device__ __forceinline__ float vec_amax(const Vec16<T>& w) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < kVec<T>; ++i) a = amax_combine(a, abs_bits(to_float(w.v[i])));
  return a;
}

// Grid-stride over 16-byte vectors, four loads in flight per thread, from the end of the
// tensor to its start: the cast that follows (current scaling) reads from the start, so
// its first reads find what this pass read last still in L2 (50 MB on an H100). A max
// does not depend on the order it is taken in.
template <typename T>
__global__ __launch_bounds__(kThreads) void amax_tensor_kernel(const T* __restrict__ x,
                                                               int64_t vectors, float* out) {
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x) + (vectors - 1);  // read as xv[-i]
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float a = 0.0f;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + 3 * stride < vectors; i += 4 * stride) {
    Vec16<T> w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = xv[-(i + j * stride)];
#pragma unroll
    for (int j = 0; j < 4; ++j) a = amax_combine(a, vec_amax(w[j]));
  }
  for (; i < vectors; i += stride) a = amax_combine(a, vec_amax(xv[-i]));
  publish_cta_amax<kWarps>(a, out);
}

// One warp per row.
template <typename T>
__global__ __launch_bounds__(kThreads) void amax_row_kernel(const T* __restrict__ x, int64_t M,
                                                            int64_t K, float* out) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= M) return;
  const Vec16<T>* xv = reinterpret_cast<const Vec16<T>*>(x + row * K);
  const int64_t vectors = K / kVec<T>;
  float a = 0.0f;
  for (int64_t i = lane; i < vectors; i += 32) a = amax_combine(a, vec_amax(xv[i]));
  a = group_amax(a, 32);
  if (lane == 0) out[row] = a;
}

// amax of the columnwise data after RHT: each thread transforms two adjacent columns over
// one block of 16 rows (columnwise blocks run down the columns of x).
template <typename T>
__global__ __launch_bounds__(kThreads) void amax_rht_kernel(const T* __restrict__ x, int64_t M,
                                                            int64_t K, float* out) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * 16;
  const int64_t k = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * 2;
  float a = 0.0f;
  if (k < K) {
    float c0[16], c1[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      c0[i] = to_float(x[(m + i) * K + k]);
      c1[i] = to_float(x[(m + i) * K + k + 1]);
    }
    float y[16];
    rht16<T>(c0, y);
#pragma unroll
    for (int i = 0; i < 16; ++i) a = amax_combine(a, abs_bits(y[i]));
    rht16<T>(c1, y);
#pragma unroll
    for (int i = 0; i < 16; ++i) a = amax_combine(a, abs_bits(y[i]));
  }
  publish_cta_amax<kWarps>(a, out);
}

ffi::Error amax(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> result,
                AmaxConfig cfg) {
  int64_t M, K;
  if (!matrix_dims(x, M, K)) return invalid("amax: x must be rank 2");
  float* out = reinterpret_cast<float*>(result->untyped_data());
  if (cfg.per_row) {
    if (M == 0) return ffi::Error::Success();
    if (K == 0) {
      cudaMemsetAsync(out, 0, M * sizeof(float), stream);
      return cuda_status("amax");
    }
  } else {
    cudaMemsetAsync(out, 0, sizeof(float), stream);
    if (M == 0 || K == 0) return cuda_status("amax");
  }
  if (cfg.rht && M % 16) return invalid("amax: RHT needs rows divisible by 16");
  return dispatch_float(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.untyped_data());
    if (K % kVec<T>) return invalid("amax: cols must fill 16-byte vectors");
    if (cfg.rht) {
      const dim3 grid(M / 16, (K / 2 + kThreads - 1) / kThreads);
      amax_rht_kernel<T><<<grid, kThreads, 0, stream>>>(xp, M, K, out);
    } else if (cfg.per_row) {
      amax_row_kernel<T><<<(M + kWarps - 1) / kWarps, kThreads, 0, stream>>>(xp, M, K, out);
    } else {
      const int64_t vectors = M * K / kVec<T>;
      amax_tensor_kernel<T><<<streaming_ctas(vectors), kThreads, 0, stream>>>(xp, vectors, out);
    }
    return cuda_status("amax");
  });
}

}  // namespace
}  // namespace jaxquant

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jaxquant::AmaxConfig,
                                      ::xla::ffi::StructMember<int32_t>("per_row"),
                                      ::xla::ffi::StructMember<int32_t>("rht"));

JAXQUANT_DEFINE_HANDLER(JaxquantAmax, jaxquant::amax,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::AnyBuffer>()
                            .Ret<xla::ffi::AnyBuffer>()
                            .Attrs<jaxquant::AmaxConfig>());

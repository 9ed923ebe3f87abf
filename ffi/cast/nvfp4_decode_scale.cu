// NVFP4's decode scale (NUMERICS.md, NVFP4 step 2) of each global amax: S_dec, the outer
// scale a GEMM multiplies its fp32 sums by. Here an IEEE fp32 division is an instruction;
// written as XLA code it is an integer emulation (XLA:GPU divides approximately), which a
// train step inlined twice for every GEMM, multiplying its compile time.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/numerics.cuh"

namespace jaxquant {
namespace {

constexpr int kDecodeScaleThreads = 128;
// The reference's S_dec of a NaN amax: its exact divisions return the canonical quiet NaN
// (nvfp4_global instead makes every scale of such a tensor 1 and flags it).
constexpr uint32_t kCanonicalNan = 0x7FC00000u;

__global__ void decode_scale_kernel(const float* __restrict__ amax, int64_t n,
                                    float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kDecodeScaleThreads + threadIdx.x;
  if (i >= n) return;
  const Nvfp4Global g = nvfp4_global(amax[i]);
  out[i] = g.nan ? __uint_as_float(kCanonicalNan) : g.s_dec;
}

ffi::Error nvfp4_decode_scale(cudaStream_t stream, ffi::Buffer<ffi::F32> amax,
                              ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(amax.element_count());
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = (n + kDecodeScaleThreads - 1) / kDecodeScaleThreads;
  decode_scale_kernel<<<blocks, kDecodeScaleThreads, 0, stream>>>(amax.typed_data(), n,
                                                                  out->typed_data());
  return cuda_status("nvfp4 decode scale");
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantNvfp4DecodeScale, jaxquant::nvfp4_decode_scale,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // global amaxes
                            .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

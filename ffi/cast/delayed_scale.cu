// Delayed scaling's next scale of each amax (NUMERICS.md, "Delayed scaling"):
// fmax / amax / 2^margin, the old scale kept where amax is zero or not finite. Here an IEEE
// fp32 division is an instruction; written as XLA code it is an integer emulation (XLA:GPU
// divides approximately), which a delayed-scaling train step inlined for every group of
// states it updates.
#include "jaxquant/bindings.h"
#include "jaxquant/ffi_glue.h"
#include "jaxquant/numerics.cuh"

namespace jaxquant {
namespace {

constexpr int kDelayedScaleThreads = 128;

__global__ void delayed_scale_kernel(const float* __restrict__ amax,
                                     const float* __restrict__ scale, int64_t n, float fmax,
                                     float divisor, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kDelayedScaleThreads + threadIdx.x;
  if (i >= n) return;
  const float a = amax[i];
  const uint32_t magnitude = __float_as_uint(a) & 0x7FFFFFFFu;
  const bool keep = magnitude == 0u || magnitude >= 0x7F800000u;  // zero, inf or NaN
  float next = fmax / a;  // IEEE division, rounded to nearest even (no fast math here)
  // x / 1 is x: the reference divides by 2^margin only for a margin other than 0.
  if (divisor != 1.0f) next = next / divisor;
  out[i] = keep ? scale[i] : next;
}

ffi::Error delayed_scale(cudaStream_t stream, ffi::Buffer<ffi::F32> amax,
                         ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out, float fmax,
                         float divisor) {
  const int64_t n = static_cast<int64_t>(amax.element_count());
  if (n == 0) return ffi::Error::Success();
  const int64_t blocks = (n + kDelayedScaleThreads - 1) / kDelayedScaleThreads;
  delayed_scale_kernel<<<blocks, kDelayedScaleThreads, 0, stream>>>(
      amax.typed_data(), scale.typed_data(), n, fmax, divisor, out->typed_data());
  return cuda_status("delayed scale");
}

}  // namespace
}  // namespace jaxquant

JAXQUANT_DEFINE_HANDLER(JaxquantDelayedScale, jaxquant::delayed_scale,
                        jaxquant::stream_binding()
                            .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // amax
                            .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale
                            .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                            .Attr<float>("fmax")
                            .Attr<float>("divisor"));

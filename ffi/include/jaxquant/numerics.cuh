// Device-side element and scale conversions, written from NUMERICS.md.
//
// Every function here is the bit-level rule of one NUMERICS.md step; kernels compose
// them and never re-derive a rule. All arithmetic is IEEE fp32 round-to-nearest-even
// (the library is built without fast-math, so division and reciprocals are exact-rounded
// and denormals are kept).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jaxquant {

constexpr float kFltMax = 3.402823466e38f;

// Element codes, as the FFI attribute `element` carries them.
enum Element : int32_t { kE4M3 = 0, kE5M2 = 1, kE2M1 = 2 };

__host__ __device__ constexpr float element_max(int32_t element) {
  return element == kE4M3 ? 448.0f : element == kE5M2 ? 57344.0f : 6.0f;
}

// ---- input element types -----------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
// NaN becomes the canonical quiet NaN (as XLA's convert gives), not the payload-keeping
// pattern of the intrinsics.
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return v != v ? __ushort_as_bfloat16(0x7FC0) : __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return v != v ? __ushort_as_half(0x7E00) : __float2half_rn(v);
}

// Largest finite value of the input dtype: the per-tensor scale used when fmax / amax
// overflows fp32 ("value_for_inf").
template <typename T> __device__ __forceinline__ float largest_finite();
template <> __device__ __forceinline__ float largest_finite<float>() { return kFltMax; }
template <> __device__ __forceinline__ float largest_finite<__nv_bfloat16>() {
  return __uint_as_float(0x7F7F0000u);
}
template <> __device__ __forceinline__ float largest_finite<__half>() { return 65504.0f; }

// ---- FP8 data ----------------------------------------------------------------------

// Canonical positive NaN codes (the reference's convention).
__host__ __device__ constexpr uint8_t fp8_nan_code(int32_t element) {
  return element == kE4M3 ? 0x7F : 0x7E;
}

// cvt_rne_satfinite of two values; returns lo code in bits 0-7 and hi code in bits 8-15.
// The hardware conversion saturates finite overflow and +-inf to +-fmax; NaN inputs are
// rewritten to the canonical code so the bits do not depend on the NaN's sign or payload.
__device__ __forceinline__ uint32_t fp8x2_code(float lo, float hi, int32_t element) {
  uint16_t packed;
  if (element == kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  }
  uint32_t out = packed;
  const uint32_t nan = fp8_nan_code(element);
  if (lo != lo) out = (out & 0xFF00u) | nan;
  if (hi != hi) out = (out & 0x00FFu) | (nan << 8);
  return out;
}

// FP8 code to float (dequantize).
__device__ __forceinline__ float fp8_to_float(uint8_t code, int32_t element) {
  if (element == kE4M3) {
    if ((code & 0x7F) == 0x7F) return __uint_as_float(0x7FC00000u);
    const uint32_t sign = (code & 0x80u) << 24;
    const uint32_t exp = (code >> 3) & 0xF, man = code & 0x7;
    float mag = exp == 0 ? float(man) * 0.001953125f  // man * 2^-9
                         : __uint_as_float(((exp + 120u) << 23) | (man << 20));
    return __uint_as_float(__float_as_uint(mag) | sign);
  }
  // E5M2 is the top byte of an fp16 with the same meaning (inf and NaN included).
  return __half2float(__ushort_as_half(static_cast<unsigned short>(code) << 8));
}

// ---- per-tensor / per-block FP8 scale (NUMERICS.md "Per-tensor FP8", steps 1-3) -----

template <typename T>
__device__ __forceinline__ float fp8_scale_from_amax(float amax, float fmax, float eps,
                                                     bool pow2) {
  float a = amax < eps ? eps : amax;
  float scale;
  if (a == 0.0f || isinf(a) || isnan(a)) {
    scale = 1.0f;
  } else {
    scale = fmax / a;
    if (isinf(scale)) scale = largest_finite<T>();
  }
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

// ---- MXFP8 (NUMERICS.md "MXFP8", steps 1-3) ----------------------------------------

// The E8M0 byte for a block amax: t = b * fl32(1/fmax), rounded up to a power of two.
__device__ __forceinline__ uint32_t mxfp8_scale_byte(float block_amax, float fmax) {
  const float t = block_amax * (1.0f / fmax);
  const uint32_t bits = __float_as_uint(t);
  const uint32_t E = (bits >> 23) & 0xFF, F = bits & 0x7FFFFF;
  if (isnan(t)) return 0xFF;
  if (isinf(t)) return 0xFE;
  if (F > 0 && E != 0xFE && !(E == 0 && F <= 0x400000u)) return E + 1;
  return E;
}

// 2^(127 - e) for e in [0, 255], exact (denormal for e >= 254).
__device__ __forceinline__ float mxfp8_quant_multiplier(uint32_t e) {
  return scalbnf(1.0f, 127 - static_cast<int>(e));
}

__device__ __forceinline__ float e8m0_to_float(uint8_t e) {
  return e == 0xFF ? __uint_as_float(0x7FC00000u) : scalbnf(1.0f, static_cast<int>(e) - 127);
}

// ---- NVFP4 (NUMERICS.md "NVFP4", steps 2-5) ----------------------------------------

// E4M3 code to float without NaN rewriting (block scales are never negative).
__device__ __forceinline__ float e4m3_to_float(uint8_t code) { return fp8_to_float(code, kE4M3); }

struct Nvfp4Global {
  float s_enc;     // S_enc
  float s_dec;     // S_dec = fl32(1 / S_enc)
  float s_enc_6;   // fl32(S_enc * fl32(1/6)), the block-scale multiplier
  bool nan;        // the global amax is NaN: every scale is 0x7F, every code 0
};

__device__ __forceinline__ Nvfp4Global nvfp4_global(float g) {
  Nvfp4Global out;
  out.nan = isnan(g);
  float s_enc = fminf(2688.0f / g, kFltMax);
  if (g == 0.0f || s_enc == 0.0f || out.nan) s_enc = 1.0f;
  out.s_enc = s_enc;
  out.s_dec = 1.0f / s_enc;
  out.s_enc_6 = s_enc * (1.0f / 6.0f);
  return out;
}

// Block scale byte s (E4M3) for a block amax (step 3).
__device__ __forceinline__ uint32_t nvfp4_scale_byte(float block_amax, const Nvfp4Global& g) {
  if (g.nan) return 0x7F;
  return fp8x2_code(block_amax * g.s_enc_6, 0.0f, kE4M3) & 0xFF;
}

// Encoding multiplier for a block (step 4).
__device__ __forceinline__ float nvfp4_block_enc(uint32_t scale_byte, const Nvfp4Global& g) {
  if (scale_byte == 0) return 0.0f;
  return fminf(1.0f / (e4m3_to_float(static_cast<uint8_t>(scale_byte)) * g.s_dec), kFltMax);
}

// E2M1 code of v = fl32(x * enc), round to nearest even, saturating (step 5).
// Magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are codes 0..7; ties go to the even code.
__device__ __forceinline__ uint32_t e2m1_code_rne(float v) {
  const float a = fabsf(v);
  uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                  (a >= 3.5f) + (a > 5.0f);
  return code | ((__float_as_uint(v) >> 28) & 0x8u);
}

// E2M1 code with stochastic rounding: round up iff frac > (u + 0.5) / 256, where frac is
// |v|'s position between the two neighbouring magnitudes and u is 8 random bits.
__device__ __forceinline__ uint32_t e2m1_code_sr(float v, uint32_t u) {
  const float a = fabsf(v);
  uint32_t code;
  if (!(a < 6.0f)) {
    code = 7;
  } else {
    // Lower neighbour: the largest magnitude <= a.
    code = (a >= 0.5f) + (a >= 1.0f) + (a >= 1.5f) + (a >= 2.0f) + (a >= 3.0f) + (a >= 4.0f);
    const float lo = code < 4 ? 0.5f * code : (code == 4 ? 2.0f : code == 5 ? 3.0f : 4.0f);
    // hi - lo is 0.5, 1 or 2: multiplying by its reciprocal is the exact division.
    const float inv_step = code < 3 ? 2.0f : code < 6 ? 1.0f : 0.5f;
    const float frac = (a - lo) * inv_step;
    const float threshold = (static_cast<float>(u) + 0.5f) * (1.0f / 256.0f);
    code += frac > threshold;
  }
  return code | ((__float_as_uint(v) >> 28) & 0x8u);
}

__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t mag = code & 7;
  const float v = mag < 4 ? 0.5f * mag : (mag == 4 ? 2.0f : mag == 5 ? 3.0f : mag == 6 ? 4.0f : 6.0f);
  return (code & 8) ? -v : v;
}

// ---- Random Hadamard transform (NUMERICS.md "RHT") -----------------------------------

// Sign vector s as a bit mask: bit i set iff s[i] == -1.
constexpr uint32_t kRhtSignMask = 0xD7E8u;  // s = [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1]

// Output j of R = diag(s) H16 / 4 applied to 16 values: the products are summed in the
// fixed order i = 0..15 in fp32, then scaled by 0.25 and rounded to the input dtype T.
// Written naively; identical prefixes across j are common subexpressions the compiler
// shares (it may not reassociate, so the order is kept).
template <typename T>
__device__ __forceinline__ void rht16(const float (&x)[16], float (&y)[16]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const bool negative = ((kRhtSignMask >> i) & 1) ^ (__popc(i & j) & 1);
      acc = negative ? acc - x[i] : acc + x[i];
    }
    y[j] = to_float(from_float<T>(acc * 0.25f));
  }
}

}  // namespace jaxquant

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

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
// NaN becomes the canonical quiet NaN (as XLA's convert gives), not the payload-keeping
// pattern of the intrinsics.
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return v != v ? __ushort_as_bfloat16(0x7FC0) : __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return v != v ? __ushort_as_half(0x7E00) : __float2half_rn(v);
}

// Largest finite value of the input dtype: the per-tensor scale used when fmax / amax
// overflows fp32 ("value_for_inf").
template <typename T>
__device__ __forceinline__ float largest_finite();
template <>
__device__ __forceinline__ float largest_finite<float>() {
  return kFltMax;
}
template <>
__device__ __forceinline__ float largest_finite<__nv_bfloat16>() {
  return __uint_as_float(0x7F7F0000u);
}
template <>
__device__ __forceinline__ float largest_finite<__half>() {
  return 65504.0f;
}

// ---- FP8 data ----------------------------------------------------------------------

// Canonical positive NaN codes (the reference's convention).
__host__ __device__ constexpr uint8_t fp8_nan_code(int32_t element) {
  return element == kE4M3 ? 0x7F : 0x7E;
}

// cvt_rne_satfinite of two values that are not NaN; returns lo code in bits 0-7 and hi
// code in bits 8-15. The hardware conversion saturates finite overflow and +-inf to +-fmax.
__device__ __forceinline__ uint32_t fp8x2_code_no_nan(float lo, float hi, int32_t element) {
  uint16_t packed;
  if (element == kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

// cvt_rne_satfinite of any two values: NaN inputs are rewritten to the canonical code so
// the bits do not depend on the NaN's sign or payload.
__device__ __forceinline__ uint32_t fp8x2_code(float lo, float hi, int32_t element) {
  uint32_t out = fp8x2_code_no_nan(lo, hi, element);
  const uint32_t nan = fp8_nan_code(element);
  if (lo != lo) out = (out & 0xFF00u) | nan;
  if (hi != hi) out = (out & 0x00FFu) | (nan << 8);
  return out;
}

// Four codes, a in bits 0-7 .. d in bits 24-31: cvt_rne_satfinite of values that are not
// NaN (one register, no repacking), and the NaN-rewriting version for any values.
__device__ __forceinline__ uint32_t fp8x4_code_no_nan(float a, float b, float c, float d,
                                                      int32_t element) {
  uint32_t out;
  if (element == kE4M3) {
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(out)
        : "f"(a), "f"(b), "f"(c), "f"(d));
  } else {
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(out)
        : "f"(a), "f"(b), "f"(c), "f"(d));
  }
  return out;
}

__device__ __forceinline__ uint32_t fp8x4_code(float a, float b, float c, float d,
                                               int32_t element) {
  return fp8x2_code(a, b, element) | (fp8x2_code(c, d, element) << 16);
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

// Two FP8 codes (bits 0-7, 8-15) as exact fp32 values; NaN codes give NaN.
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t codes, int32_t element) {
  uint32_t h2;
  const uint16_t c = static_cast<uint16_t>(codes);
  if (element == kE4M3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(c));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(c));
  }
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

// Two E2M1 codes (bits 0-3, 4-7) as fp16 bit patterns scaled by 2^-14: the code's three
// magnitude bits placed at fp16 bits 9-11 mean 2^-14 times the E2M1 value, normal and
// subnormal codes alike.
__device__ __forceinline__ float2 e2m1x2_to_float2_scaled(uint32_t codes) {
  const uint32_t h2 = ((codes & 0x7u) << 9) | ((codes & 0x8u) << 12) | ((codes & 0x70u) << 21) |
                      ((codes & 0x80u) << 24);
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

// ---- per-tensor / per-block FP8 scale (NUMERICS.md "Per-tensor FP8", steps 1-3) -----

template <typename T>
__device__ __forceinline__ float fp8_scale_from_amax(float amax, float fmax, float eps, bool pow2) {
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
// The block amax is a magnitude (sign bit clear, NaN included). Adding all-ones below the
// exponent field rounds a normal t up; a subnormal t rounds up to 2^-126 only above half
// of it, and 0xFE stays 0xFE (NUMERICS.md's E and F rules; equal to them for every t,
// checked exhaustively on the host).
__device__ __forceinline__ uint32_t mxfp8_scale_byte(float block_amax, float fmax) {
  const uint32_t bits = __float_as_uint(block_amax * (1.0f / fmax));
  const uint32_t finite = bits <= 0x400000u ? 0u : min((bits + 0x7FFFFFu) >> 23, 0xFEu);
  const uint32_t special = bits == 0x7F800000u ? 0xFEu : 0xFFu;  // inf, NaN
  return bits >= 0x7F800000u ? special : finite;
}

// 2^(127 - e) for e in [0, 255], built from its bits: normal for e <= 253, the
// subnormals 2^-127 and 2^-128 for e = 254, 255.
__device__ __forceinline__ float mxfp8_quant_multiplier(uint32_t e) {
  return __uint_as_float(e <= 253u ? (254u - e) << 23 : 0x00800000u >> (e - 253u));
}

// 2^(e - 127); 0xFF is NaN, e = 0 the subnormal 2^-127.
__device__ __forceinline__ float e8m0_to_float(uint8_t e) {
  if (e == 0xFF) return __uint_as_float(0x7FC00000u);
  return __uint_as_float(e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23);
}

// ---- NVFP4 (NUMERICS.md "NVFP4", steps 2-5) ----------------------------------------

// E4M3 code to float without NaN rewriting (block scales are never negative).
__device__ __forceinline__ float e4m3_to_float(uint8_t code) { return fp8_to_float(code, kE4M3); }

struct Nvfp4Global {
  float s_enc;    // S_enc
  float s_dec;    // S_dec = fl32(1 / S_enc)
  float s_enc_6;  // fl32(S_enc * fl32(1/6)), the block-scale multiplier
  bool nan;       // the global amax is NaN: every scale is 0x7F, every code 0
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
// A block amax is NaN only when its domain's global amax is, so the conversion needs no
// NaN rewrite.
__device__ __forceinline__ uint32_t nvfp4_scale_byte(float block_amax, const Nvfp4Global& g) {
  if (g.nan) return 0x7F;
  return fp8x2_code_no_nan(block_amax * g.s_enc_6, 0.0f, kE4M3) & 0xFF;
}

// Encoding multiplier for a block (step 4).
__device__ __forceinline__ float nvfp4_block_enc(uint32_t scale_byte, const Nvfp4Global& g) {
  if (scale_byte == 0) return 0.0f;
  return fminf(1.0f / (e4m3_to_float(static_cast<uint8_t>(scale_byte)) * g.s_dec), kFltMax);
}

// E2M1 magnitude code of v = fl32(x * enc) (step 5), biased: the functions below return
// code + bias modulo 2^32, the bias a by-product of their arithmetic. A packed word of
// codes is then one multiply-add per element and one subtraction per word (nvfp4.cu;
// codes are below 8, so the nibbles never carry). The sign is the caller's: v's sign bit.
//
// Round to nearest even: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are codes 0..7; ties go to
// the even code, and magnitudes past 6 saturate. The grid spacing is 0.5 below 2, 1 in
// [2, 4) and 2 in [4, 6]: with a = min(|v|, 6) and `over` = 0, 1, 2 for these ranges,
// code = RNE(a * 2^(1 - over)) + 2 * over, where the RNE to an integer is one FFMA with
// 1.5 * 2^23 (a single rounding, ties to even). Equal to the seven-threshold definition for
// every non-NaN v (checked exhaustively on the host); v is never NaN here (a NaN input
// makes the global amax NaN, and then every code is 0).
constexpr uint32_t kE2m1RneBias = 0x4B400000u + 2u * 127u;

__device__ __forceinline__ uint32_t e2m1_biased_rne(float v) {
  const float a = fminf(fabsf(v), 6.0f);
  const uint32_t e = max(__float_as_uint(a) >> 23, 127u);    // 127 + over
  const float step_inv = __uint_as_float((255u - e) << 23);  // 2^(1 - over)
  return __float_as_uint(fmaf(a, step_inv, 12582912.0f)) + 2u * e;
}

// Stochastic rounding: round up iff frac > t = (u + 0.5) / 256, where frac is |v|'s
// position between the two neighbouring magnitudes and u is 8 random bits. On the scaled
// grid above (y = a * 2^(1 - over), neighbours at integers) the code index is ceil(y - t):
// y - 1 - t and the integer conversion are both rounded toward +inf, which keeps the ceiling
// exact; 1 + t is built from its bits. Equal to the definition (checked on the host for
// every |v| < 16 with u in {0, 77, 255}, and 5e7 random (v, u)).
constexpr uint32_t kE2m1SrBias = kE2m1RneBias - 1u;

__device__ __forceinline__ uint32_t e2m1_biased_sr(float v, uint32_t u) {
  const float a = fminf(fabsf(v), 6.0f);
  const uint32_t e = max(__float_as_uint(a) >> 23, 127u);
  const float step_inv = __uint_as_float((255u - e) << 23);
  const float one_plus_t = __uint_as_float(0x3F800000u | ((2u * u + 1u) << 14));
  const float below = __fmaf_ru(a, step_inv, -one_plus_t);  // ceil of it is index - 1
  return __float_as_uint(__fadd_ru(below, 12582912.0f)) + 2u * e;
}

// The bias of n packed codes: `bias` in each of the n nibble positions, summed mod 2^32.
__host__ __device__ constexpr uint32_t packed_bias(uint32_t bias, int n) {
  uint32_t sum = 0;
  for (int i = 0; i < n; ++i) sum += bias << (4 * i);
  return sum;
}

__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t mag = code & 7;
  const float v = mag < 4 ? 0.5f * mag
                          : (mag == 4   ? 2.0f
                             : mag == 5 ? 3.0f
                             : mag == 6 ? 4.0f
                                        : 6.0f);
  return (code & 8) ? -v : v;
}

// ---- Random Hadamard transform (NUMERICS.md "RHT") -----------------------------------

// Sign vector s as a bit mask: bit i set iff s[i] == -1.
constexpr uint32_t kRhtSignMask = 0xD7E8u;  // s = [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1]

// Output j of R = diag(s) H16 / 4 applied to 16 values: the terms sign(s_i H16[i, j]) x_i
// are summed in the fixed order i = 0..15 in fp32, starting from term 0 (so a block whose
// terms are all -0 sums to -0), then scaled by 0.25 and rounded to the input dtype T.
// Written naively; identical prefixes across j are common subexpressions the compiler
// shares (it may not reassociate, so the order is kept). A fast Walsh-Hadamard butterfly
// (64 adds instead of 170, taken where every partial sum is exact) measured slower in the
// cast and the amax on an H100, and gives other signs of zero: -(a + b) is not -a + -b
// when the sum is 0.
template <typename T>
__device__ __forceinline__ void rht16_rounded(const float (&x)[16], T (&y)[16]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    float acc = (kRhtSignMask & 1) ? -x[0] : x[0];  // H16[0, j] = 1
#pragma unroll
    for (int i = 1; i < 16; ++i) {
      const bool negative = ((kRhtSignMask >> i) & 1) ^ (__popc(i & j) & 1);
      acc = negative ? acc - x[i] : acc + x[i];
    }
    y[j] = from_float<T>(acc * 0.25f);
  }
}

// The same outputs as fp32 values (for their amax).
template <typename T>
__device__ __forceinline__ void rht16(const float (&x)[16], float (&y)[16]) {
  T rounded[16];
  rht16_rounded<T>(x, rounded);
#pragma unroll
  for (int j = 0; j < 16; ++j) y[j] = to_float(rounded[j]);
}

}  // namespace jaxquant

// Scalar conversions between float and the 16-bit formats, bit-exact with the hardware ones
// (round to nearest even, NaN kept quiet). static inline, no intrinsics: included both inside the
// ISA namespaces (by vec.h) and by baseline code. Needs <cstring>, <cstdint>, <cmath>.
#pragma once

// Scalar half-precision conversions (baseline, and anywhere a lane is handled alone).
static inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: value = man * 2^-24, exact in float
    float f = (float)man * 5.9604644775390625e-08f;
    uint32_t fb;
    std::memcpy(&fb, &f, 4);
    bits = sign | fb;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

static inline uint16_t float_to_f16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (ax >= 0x38800000u) {  // normal half
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);  // round to nearest even at bit 13
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
  }
  // Subnormal half or zero: scale so the half's unit (2^-24) is float's integer 1 and round there.
  float af;
  std::memcpy(&af, &ax, 4);
  const float scaled = af * 16777216.0f;  // exact: a power of two
  const float r = std::nearbyint(scaled);  // default rounding mode: nearest even
  return (uint16_t)(sign | (uint16_t)r);
}

static inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

static inline uint16_t float_to_bf16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);  // nearest even
}

// A double to float rounded to odd (truncated, the last bit set when anything was dropped): rounded
// on to a format of at least two fewer significand bits, it gives the double's own nearest even,
// where float's nearest even first could land on a tie and round twice.
static inline float double_to_float_odd(double d) {
  float f = (float)d;
  if ((double)f == d || d != d || std::isinf(f)) return f;  // exact, NaN, or past float's range
  if (std::fabs((double)f) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= 1u;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t double_to_f16_bits(double d) { return float_to_f16_bits(double_to_float_odd(d)); }
static inline uint16_t double_to_bf16_bits(double d) { return float_to_bf16_bits(double_to_float_odd(d)); }

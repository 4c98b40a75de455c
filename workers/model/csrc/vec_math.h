// Vector helpers shared by pdserve's CPU kernels (GCC vector extensions: 16 floats are one zmm
// register with AVX-512, two ymm with AVX2). cpu_kernels.py folds this header's digest into the
// build flags, so editing it rebuilds every kernel that includes it.
#pragma once

#include <cstdint>
#include <cstring>

namespace pdserve_vec {

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// exp over 16 lanes: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by Cephes'
// expf polynomial (about 1 ulp). Inputs are clamped to [-87, 88]: below, the result is 0;
// above, it is +inf (as expf overflows).
inline vf16 exp16(vf16 x) {
  const vi16 lo = x < -87.f;  // all bits set where true
  const vi16 hi = x > 88.f;
  x = lo ? vf16{} - 87.f : x;
  x = hi ? vf16{} + 88.f : x;
  const vf16 shift = vf16{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  vf16 n = (x * 1.44269504088896341f + shift) - shift;
  vf16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf16 p = vf16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  vf16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vf16 out = p * scale;
  out = lo ? vf16{} : out;
  return hi ? vf16{} + __builtin_inff() : out;
}

}  // namespace pdserve_vec

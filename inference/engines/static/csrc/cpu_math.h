// What the extension's kernels share: their builds per CPU and one polynomial exp, so that every kernel that needs exp
// rounds alike on every CPU and in every vector width.
#pragma once

#include <cstdint>
#include <cstring>

// x86-64: an AVX-512, an AVX2 and a baseline build of each hot function, chosen by the CPU at load; elsewhere
// (aarch64) the one build the compiler makes.
#if defined(__x86_64__) && defined(__GNUC__)
#define HEADWAY_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HEADWAY_CLONES
#endif

// The bits of `from` as a `To` of the same size (scalars or GCC vectors).
template <typename To, typename From>
inline __attribute__((always_inline)) To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast: sizes differ");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// exp's range reduction for x <= 0: x clamped to >= -87, t = x / ln 2 + 1.5 * 2^23 (rounding x / ln 2 to the nearest
// integer n, which is then the low bits of t's mantissa) and n itself.
template <typename F>
inline __attribute__((always_inline)) void exp_reduce(F& x, F& t, F& n) {
  const F low = F{} + -87.0f;
  x = x < low ? low : x;
  t = x * 1.44269504088896341f + 12582912.0f;
  n = t - 12582912.0f;
}

// 2^n as a float from exp_reduce's t (0x4B400000: the bits of 1.5 * 2^23).
template <typename F, typename I>
inline __attribute__((always_inline)) F exp_scale(F t) {
  return bit_cast<F>((bit_cast<I>(t) - 0x4B400000 + 127) << 23);
}

// exp(x) for x <= 0: Cephes' expf polynomial after range reduction; within about 2 ulp of std::exp for x >= -87
// (below, exp(-87)). F is float (I int32_t) or a GCC vector of floats (I the int32 vector of its width): the same
// operations in the same order, so a vector lane and the scalar give the same bits.
template <typename F, typename I>
inline __attribute__((always_inline)) F exp_nonpositive_t(F x) {
  F t, n;
  exp_reduce(x, t, n);
  x = x - n * 0.693359375f;
  x = x + n * 2.12194440e-4f;
  const F z = x * x;
  F y = F{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  return y * exp_scale<F, I>(t);
}

inline __attribute__((always_inline)) float exp_nonpositive(float x) { return exp_nonpositive_t<float, int32_t>(x); }

// exp(x) for x <= 0 to about 3e-6 relative error, for values rounded to bf16 (2^-9) next (prompt_attention.cpp's
// probabilities): exp_reduce, one constant for ln 2 and a degree-5 Taylor polynomial, about half exp_nonpositive_t's
// operations; below -87 it returns exp(-87).
template <typename F, typename I>
inline __attribute__((always_inline)) F exp_nonpositive_fast_t(F x) {
  F t, n;
  exp_reduce(x, t, n);
  const F r = x - n * 0.693147180559945f;
  F y = F{} + 8.3333333e-3f;
  y = y * r + 4.1666667e-2f;
  y = y * r + 1.6666667e-1f;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  return y * exp_scale<F, I>(t);
}

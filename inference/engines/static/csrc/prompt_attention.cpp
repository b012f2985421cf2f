// Causal attention of a fresh bf16 prompt through oneDNN's bf16 batch-reduce GEMM (ATen's cpublas::brgemm: AMX tiles
// or AVX512-BF16). torch's CPU flash attention splits a 1,000-token prompt into blocks of 256 queries by 512 keys, so
// its causal skip saves only about a quarter of the work, and it spent ~5 ms per layer of the default target at one
// thread, a third of the prompt's time. Here each block of 64 query rows computes its scores against only the keys
// it sees, in tiles of 64 keys, takes the softmax over each whole row at once (no running rescale), and accumulates
// the probabilities times the values tile by tile. `prompt_attention_f32` does the same for float32 prompts on float32
// brgemm (whole rows of seen keys per call, float32 probabilities), ~1.4x faster than torch's float32 flash attention.
#include "prompt_attention.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

using at::Tensor;

namespace {

constexpr int64_t kRows = 64;  // query rows per task: the M of every GEMM
constexpr int64_t kKeys = 64;  // keys per score tile: the N of the scores' GEMMs (the packed key tile's width)
// The softmax runs in 16 lanes where the CPU has AVX-512 and in 8 elsewhere: GCC splits a 16-float vector's
// comparisons into scalars in an AVX2 build, and 8-float ones lower to one instruction each there.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

// One row's softmax over its scores s[0, width) (width a multiple of 16), of which s[0, valid) are seen: p gets the
// bf16 of exp(scale * s - max) there (rounded to nearest even) and 0 past it; returns the float sum of the exps.
// F is a vector of L floats, I and U its int32 and uint32 vectors, H its bf16 (uint16) vector.
template <typename F, typename I, typename U, typename H, int64_t L>
inline __attribute__((always_inline)) float softmax_row_t(const float* s, int64_t valid, int64_t width, float scale,
                                                          uint16_t* p) {
  const F vscale = F{} + scale, lowest = F{} + -3.0e38f, zero = {};
  I lane;
  for (int64_t l = 0; l < L; ++l) lane[l] = static_cast<int32_t>(l);
  const I last = I{} + static_cast<int32_t>(valid);
  F vmax = lowest;
  for (int64_t j0 = 0; j0 < valid; j0 += L) {
    F x;
    std::memcpy(&x, s + j0, sizeof(x));
    x = x * vscale;
    x = lane + static_cast<int32_t>(j0) < last ? x : lowest;
    vmax = x > vmax ? x : vmax;
  }
  float m = vmax[0];
  for (int64_t l = 1; l < L; ++l) m = std::max(m, vmax[l]);
  const F vm = F{} + m;
  F sums = {};
  for (int64_t j0 = 0; j0 < width; j0 += L) {
    F e = zero;
    if (j0 < valid) {
      std::memcpy(&e, s + j0, sizeof(e));
      e = exp_nonpositive_fast_t<F, I>(e * vscale - vm);
      e = lane + static_cast<int32_t>(j0) < last ? e : zero;
    }
    sums = sums + e;
    const U bits = bit_cast<U>(e);  // e is finite and >= 0: round to nearest even
    const H h = __builtin_convertvector((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, H);
    std::memcpy(p + j0, &h, sizeof(h));
  }
  for (int64_t w = L / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) sums[l] = sums[l] + sums[l + w];
  }
  return sums[0];
}

// softmax_row_t for float32 probabilities: p gets exp(scale * s - max) (exp_nonpositive_t: about 2 ulp) over the seen
// scores and 0 past them, in 16 lanes (one AVX-512 register or two AVX2 ones, the same arithmetic).
inline __attribute__((always_inline)) float softmax_row_f32_t(const float* s, int64_t valid, int64_t width,
                                                              float scale, float* p) {
  constexpr int64_t L = 16;
  const v16 vscale = v16{} + scale, lowest = v16{} + -3.0e38f, zero = {};
  v16i lane;
  for (int64_t l = 0; l < L; ++l) lane[l] = static_cast<int32_t>(l);
  const v16i last = v16i{} + static_cast<int32_t>(valid);
  v16 vmax = lowest;
  for (int64_t j0 = 0; j0 < valid; j0 += L) {
    v16 x;
    std::memcpy(&x, s + j0, sizeof(x));
    x = x * vscale;
    x = lane + static_cast<int32_t>(j0) < last ? x : lowest;
    vmax = x > vmax ? x : vmax;
  }
  float m = vmax[0];
  for (int64_t l = 1; l < L; ++l) m = std::max(m, vmax[l]);
  const v16 vm = v16{} + m;
  v16 sums = {};
  for (int64_t j0 = 0; j0 < width; j0 += L) {
    v16 e = zero;
    if (j0 < valid) {
      std::memcpy(&e, s + j0, sizeof(e));
      e = exp_nonpositive_t<v16, v16i>(e * vscale - vm);
      e = lane + static_cast<int32_t>(j0) < last ? e : zero;
    }
    sums = sums + e;
    std::memcpy(p + j0, &e, sizeof(e));
  }
  for (int64_t w = L / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) sums[l] = sums[l] + sums[l + w];
  }
  return sums[0];
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,fma"))) float softmax_row_f32_avx512(const float* s, int64_t valid, int64_t width,
                                                                    float scale, float* p) {
  return softmax_row_f32_t(s, valid, width, scale, p);
}

__attribute__((target("avx2,fma"))) float softmax_row_f32_avx2(const float* s, int64_t valid, int64_t width,
                                                               float scale, float* p) {
  return softmax_row_f32_t(s, valid, width, scale, p);
}
#endif

float softmax_row_f32_base(const float* s, int64_t valid, int64_t width, float scale, float* p) {
  return softmax_row_f32_t(s, valid, width, scale, p);
}

using SoftmaxRowF32 = float (*)(const float*, int64_t, int64_t, float, float*);

SoftmaxRowF32 pick_softmax_row_f32() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f")) return softmax_row_f32_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return softmax_row_f32_avx2;
#endif
  return softmax_row_f32_base;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,fma"), optimize("fp-contract=fast"))) float softmax_row_avx512(const float* s, int64_t valid, int64_t width, float scale,
                                                             uint16_t* p) {
  return softmax_row_t<v16, v16i, v16u, v16h, 16>(s, valid, width, scale, p);
}

__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) float softmax_row_avx2(const float* s, int64_t valid, int64_t width, float scale,
                                                       uint16_t* p) {
  return softmax_row_t<v8, v8i, v8u, v8h, 8>(s, valid, width, scale, p);
}
#endif

float softmax_row_base(const float* s, int64_t valid, int64_t width, float scale, uint16_t* p) {
  return softmax_row_t<v8, v8i, v8u, v8h, 8>(s, valid, width, scale, p);
}

using SoftmaxRow = float (*)(const float*, int64_t, int64_t, float, uint16_t*);

SoftmaxRow pick_softmax_row() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f")) return softmax_row_avx512;
  if (__builtin_cpu_supports("avx2")) return softmax_row_avx2;
#endif
  return softmax_row_base;
}

// A key tile transposed into the VNNI layout brgemm takes for B = K^T [head_dim, kKeys]: the pair of dimensions
// (2 d2, 2 d2 + 1) of key j at out[(d2 * kKeys + j) * 2], zero for keys past `count`.
void pack_keys(const at::BFloat16* k, int64_t count, int64_t head_dim, at::BFloat16* out) {
  const int64_t pairs = head_dim / 2;
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  std::memset(static_cast<void*>(o), 0, pairs * kKeys * sizeof(uint32_t));
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(k + j * head_dim);
    for (int64_t d2 = 0; d2 < pairs; ++d2) o[d2 * kKeys + j] = row[d2];
  }
}

// A tile of value rows in the VNNI layout for B = V [kKeys, head_dim]: rows 2 r2 and 2 r2 + 1 interleaved,
// element d of the pair at out[(r2 * head_dim + d) * 2], zero for rows past `count`.
void pack_values(const at::BFloat16* v, int64_t count, int64_t head_dim, at::BFloat16* out) {
  const uint16_t* in = reinterpret_cast<const uint16_t*>(v);
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t r2 = 0; r2 < kKeys / 2; ++r2) {
    const int64_t r = 2 * r2;
    uint16_t* dest = o + r2 * head_dim * 2;
    for (int64_t d = 0; d < head_dim; ++d) {
      dest[2 * d] = r < count ? in[r * head_dim + d] : 0;
      dest[2 * d + 1] = r + 1 < count ? in[(r + 1) * head_dim + d] : 0;
    }
  }
}

// One output row: bf16(acc * inv), rounded to nearest even (acc is finite).
void finish_row(const float* acc, float inv, int64_t head_dim, uint16_t* out) {
  for (int64_t d = 0; d < head_dim; ++d) {
    const float x = acc[d] * inv;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    out[d] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

}  // namespace

bool prompt_attention_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

bool prompt_attention_f32_available() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

Tensor prompt_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prompt_attention: q, k and v must be bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous(),
              "prompt_attention: q [heads, n, head_dim], k and v [kv_heads, n, head_dim], contiguous");
  const int64_t heads = q.size(0), n = q.size(1), head_dim = q.size(2), kv = k.size(0);
  TORCH_CHECK(k.size(1) == n && k.size(2) == head_dim && kv > 0 && heads % kv == 0 && head_dim % 2 == 0,
              "prompt_attention: k and v do not match q (n, head_dim, or heads not a multiple of kv_heads)");
  const int64_t tiles = (n + kKeys - 1) / kKeys, padded = tiles * kKeys, blocks = (n + kRows - 1) / kRows;
  // keys and values packed once per key-value head, tile by tile
  Tensor kp = at::empty({kv, tiles, head_dim * kKeys}, q.options());
  Tensor vp = at::empty({kv, tiles, kKeys * head_dim}, q.options());
  const at::BFloat16 *qd = q.data_ptr<at::BFloat16>(), *kd = k.data_ptr<at::BFloat16>(),
                     *vd = v.data_ptr<at::BFloat16>();
  at::BFloat16 *kpd = kp.data_ptr<at::BFloat16>(), *vpd = vp.data_ptr<at::BFloat16>();
  at::parallel_for(0, kv * tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t h = t / tiles, tile = t % tiles, first = tile * kKeys, count = std::min(kKeys, n - first);
      pack_keys(kd + (h * n + first) * head_dim, count, head_dim, kpd + t * head_dim * kKeys);
      pack_values(vd + (h * n + first) * head_dim, count, head_dim, vpd + t * kKeys * head_dim);
    }
  });
  Tensor out = at::empty({n, heads * head_dim}, q.options());
  at::BFloat16* od = out.data_ptr<at::BFloat16>();
  const int64_t group = heads / kv;
  const float fscale = static_cast<float>(scale);
  // Tasks pair a block of early rows with one of late rows (blocks 0, last, 1, last - 1, ...), so that the
  // contiguous ranges parallel_for gives the threads cost about the same under the causal mask.
  at::parallel_for(0, heads * blocks, 1, [&](int64_t b, int64_t e) {
    std::unique_ptr<float[]> scores(new float[kRows * padded]);
    std::unique_ptr<uint16_t[]> probs(new uint16_t[kRows * padded]);
    std::unique_ptr<float[]> acc(new float[kRows * head_dim]);
    float sums[kRows];
    static const SoftmaxRow softmax_row = pick_softmax_row();
    for (int64_t t = b; t < e; ++t) {
      const int64_t order = t / heads, h = t % heads;
      const int64_t block = order % 2 == 0 ? order / 2 : blocks - 1 - order / 2;
      const int64_t first = block * kRows, rows = std::min(kRows, n - first), seen = first + rows;
      const int64_t used = (seen + kKeys - 1) / kKeys;  // key tiles these rows see
      const at::BFloat16* qb = qd + (h * n + first) * head_dim;
      const int64_t g = h / group;
      for (int64_t tile = 0; tile < used; ++tile) {
        at::native::cpublas::brgemm(rows, kKeys, head_dim, head_dim, kKeys, padded, false, qb,
                                    kpd + (g * tiles + tile) * head_dim * kKeys, scores.get() + tile * kKeys);
      }
      for (int64_t r = 0; r < rows; ++r) {
        sums[r] = softmax_row(scores.get() + r * padded, first + r + 1, used * kKeys, fscale, probs.get() + r * padded);
      }
      for (int64_t tile = 0; tile < used; ++tile) {
        at::native::cpublas::brgemm(rows, head_dim, kKeys, padded, head_dim, head_dim, tile > 0,
                                    reinterpret_cast<const at::BFloat16*>(probs.get()) + tile * kKeys,
                                    vpd + (g * tiles + tile) * kKeys * head_dim, acc.get());
      }
      for (int64_t r = 0; r < rows; ++r) {
        finish_row(acc.get() + r * head_dim, 1.0f / sums[r], head_dim,
                   reinterpret_cast<uint16_t*>(od + (first + r) * heads * head_dim + h * head_dim));
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}

Tensor prompt_attention_f32(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prompt_attention_f32: q, k and v must be float32");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous(),
              "prompt_attention_f32: q [heads, n, head_dim], k and v [kv_heads, n, head_dim], contiguous");
  const int64_t heads = q.size(0), n = q.size(1), head_dim = q.size(2), kv = k.size(0);
  TORCH_CHECK(k.size(1) == n && k.size(2) == head_dim && kv > 0 && heads % kv == 0,
              "prompt_attention_f32: k and v do not match q (n, head_dim, or heads not a multiple of kv_heads)");
  const int64_t tiles = (n + kKeys - 1) / kKeys, padded = tiles * kKeys, blocks = (n + kRows - 1) / kRows;
  // per key-value head: the keys transposed [head_dim, padded] and the values [padded, head_dim], zero past n
  Tensor kt = at::zeros({kv, head_dim, padded}, q.options());
  Tensor vp = at::zeros({kv, padded, head_dim}, q.options());
  kt.narrow(2, 0, n).copy_(k.transpose(1, 2));
  vp.narrow(1, 0, n).copy_(v);
  const float *qd = q.data_ptr<float>(), *ktd = kt.data_ptr<float>(), *vpd = vp.data_ptr<float>();
  Tensor out = at::empty({n, heads * head_dim}, q.options());
  float* od = out.data_ptr<float>();
  const int64_t group = heads / kv;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, heads * blocks, 1, [&](int64_t b, int64_t e) {
    std::unique_ptr<float[]> scores(new float[kRows * padded]);
    std::unique_ptr<float[]> probs(new float[kRows * padded]);
    std::unique_ptr<float[]> acc(new float[kRows * head_dim]);
    float sums[kRows];
    static const SoftmaxRowF32 softmax_row = pick_softmax_row_f32();
    for (int64_t t = b; t < e; ++t) {
      const int64_t order = t / heads, h = t % heads;  // early and late blocks alternate, as prompt_attention's
      const int64_t block = order % 2 == 0 ? order / 2 : blocks - 1 - order / 2;
      const int64_t first = block * kRows, rows = std::min(kRows, n - first), seen = first + rows;
      const int64_t width = (seen + kKeys - 1) / kKeys * kKeys;  // the keys these rows see, in whole tiles
      const int64_t g = h / group;
      at::native::cpublas::brgemm(rows, width, head_dim, head_dim, padded, padded, false,
                                  qd + (h * n + first) * head_dim, ktd + g * head_dim * padded, scores.get());
      for (int64_t r = 0; r < rows; ++r) {
        sums[r] = softmax_row(scores.get() + r * padded, first + r + 1, width, fscale, probs.get() + r * padded);
      }
      at::native::cpublas::brgemm(rows, head_dim, width, padded, head_dim, head_dim, false, probs.get(),
                                  vpd + g * padded * head_dim, acc.get());
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / sums[r];
        float* dest = od + (first + r) * heads * head_dim + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dest[d] = acc[r * head_dim + d] * inv;
      }
    }
  });
  return out;
}

// Fused element-wise kernels for the C++ layer loop's bf16 steps (csrc/layer_loop.cpp, `run_fused`): a 1,000-token
// prompt of the default target spent about as long in ATen's ~15 element-wise passes per layer (RMSNorm's float copy,
// square, mean, rsqrt and products; rotary's products, flip and sum; SiLU and its product; the residual adds) as in its
// attention, and a one-token step made ~15 small calls per layer for them. Each kernel here reads its rows once. Every
// output element has one fixed order of arithmetic that depends only on its own row (threads split the rows, never a
// sum), so neither the other rows of a step, the thread count nor the CPU's vector width changes a bit: a tree's rows
// stay one-token steps. The rotary and residual arithmetic is torch's, rounding for rounding; RMSNorm's sum of squares
// runs in 16 lanes and SiLU's exp is cpu_math.h's polynomial, so those two can differ from ATen's in the last bit of a
// bf16.
#include "fused_ops.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

using at::Tensor;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGrain = 8;  // rows per task: a prompt's rows split over the threads, a decoding step's run on one
constexpr int64_t kTableRows = 64;  // rows from which silu_mul looks SiLU up (silu_table) instead of computing it

// 16 lanes: GCC lowers each operation to one AVX-512 register, two AVX2 ones or four SSE ones, the same IEEE
// arithmetic per lane in every build (no fused multiply-adds: the build's -ffp-contract=off)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

// `count` <= 16 bf16 values from p as floats (exact), zero past count
inline __attribute__((always_inline)) v16 load_bf16(const uint16_t* p, int64_t count) {
  v16h h = {};
  if (count == kLanes) {  // a whole block: one fixed-size copy, i.e. one vector load
    std::memcpy(&h, p, sizeof(h));
  } else {
    std::memcpy(&h, p, count * sizeof(uint16_t));
  }
  return bit_cast<v16>(__builtin_convertvector(h, v16u) << 16);
}

// floats rounded to bf16 as c10::BFloat16 rounds (to nearest even; NaN to 0x7FC0)
inline __attribute__((always_inline)) v16h to_bf16(v16 f) {
  const v16u bits = bit_cast<v16u>(f);
  const v16u rounded = f != f ? v16u{} + 0x7FC00000u : bits + 0x7FFFu + ((bits >> 16) & 1u);
  return __builtin_convertvector(rounded >> 16, v16h);
}

inline __attribute__((always_inline)) void store_bf16(uint16_t* p, v16 f, int64_t count) {
  const v16h h = to_bf16(f);
  if (count == kLanes) {
    std::memcpy(p, &h, sizeof(h));
  } else {
    std::memcpy(p, &h, count * sizeof(uint16_t));
  }
}

// what a bf16 tensor op's result holds: the float rounded to bf16, as a float
inline __attribute__((always_inline)) v16 round_bf16(v16 f) {
  return bit_cast<v16>(__builtin_convertvector(to_bf16(f), v16u) << 16);
}

// One row of add_rms_norm: sum_out (where given) and tmp (whole blocks of 16) get bf16(x + delta) (or x), out the
// normed row; the sum of squares in 16 lanes (element d in lane d % 16), folded in a fixed tree.
HEADWAY_CLONES void norm_row(const uint16_t* x, const uint16_t* delta, const uint16_t* weight, int64_t hidden,
                             float eps, uint16_t* sum_out, float* tmp, uint16_t* out) {
  v16 squares = {};
  for (int64_t d0 = 0; d0 < hidden; d0 += kLanes) {
    const int64_t count = std::min(kLanes, hidden - d0);
    v16 s = load_bf16(x + d0, count);
    if (delta != nullptr) s = round_bf16(s + load_bf16(delta + d0, count));
    std::memcpy(tmp + d0, &s, sizeof(s));
    squares = squares + s * s;
  }
  float lanes[kLanes];
  std::memcpy(lanes, &squares, sizeof(lanes));
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lanes[l] = lanes[l] + lanes[l + w];
  }
  const float r = 1.0f / std::sqrt(lanes[0] / static_cast<float>(hidden) + eps);
  for (int64_t d0 = 0; d0 < hidden; d0 += kLanes) {
    const int64_t count = std::min(kLanes, hidden - d0);
    v16 s;
    std::memcpy(&s, tmp + d0, sizeof(s));
    store_bf16(out + d0, load_bf16(weight + d0, count) * round_bf16(s * r), count);
    if (sum_out != nullptr) store_bf16(sum_out + d0, s, count);
  }
}

// One head of one row: out[d] = bf16(bf16(x[d] * cos[d]) + bf16(x[d +- half] * sin[d])).
HEADWAY_CLONES void rope_row(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim,
                             uint16_t* out) {
  const int64_t half = dim / 2;
  for (int64_t side = 0; side < 2; ++side) {
    const int64_t self = side * half, partner = half - self;
    for (int64_t d0 = 0; d0 < half; d0 += kLanes) {
      const int64_t count = std::min(kLanes, half - d0), d = self + d0;
      const v16 a = round_bf16(load_bf16(x + d, count) * load_bf16(cos + d, count));
      const v16 b = round_bf16(load_bf16(x + partner + d0, count) * load_bf16(sin + d, count));
      store_bf16(out + d, a + b, count);
    }
  }
}

// One row of silu_mul: silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) <= 1 on either side of 0.
HEADWAY_CLONES void silu_mul_row(const uint16_t* gate, const uint16_t* up, int64_t inter, uint16_t* out) {
  const v16 one = v16{} + 1.0f, zero = {};
  for (int64_t d0 = 0; d0 < inter; d0 += kLanes) {
    const int64_t count = std::min(kLanes, inter - d0);
    const v16 g = load_bf16(gate + d0, count);
    const v16 e = exp_nonpositive_t<v16, v16i>(g < zero ? g : -g);
    const v16 silu = g * (g < zero ? e : one) / (one + e);
    store_bf16(out + d0, round_bf16(silu) * load_bf16(up + d0, count), count);
  }
}

// One row of silu_mul through `table` (silu_table): out = bf16(table[gate] * up), silu_mul_row's bits.
HEADWAY_CLONES void silu_mul_row_table(const uint16_t* gate, const uint16_t* up, const float* table, int64_t inter,
                                       uint16_t* out) {
  for (int64_t d = 0; d < inter; ++d) {
    const uint32_t ub = static_cast<uint32_t>(up[d]) << 16;
    const float p = table[gate[d]] * bit_cast<float>(ub);
    const uint32_t b = bit_cast<uint32_t>(p);
    out[d] = static_cast<uint16_t>((p != p ? 0x7FC00000u : b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
}

// float32 rows (a float32 target's fused loop): the same passes without the bf16 rounding. `count` <= 16 floats.
inline __attribute__((always_inline)) v16 load_f32(const float* p, int64_t count) {
  v16 v = {};
  if (count == kLanes) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    std::memcpy(&v, p, count * sizeof(float));
  }
  return v;
}

inline __attribute__((always_inline)) void store_f32(float* p, v16 v, int64_t count) {
  if (count == kLanes) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    std::memcpy(p, &v, count * sizeof(float));
  }
}

// norm_row for float32: sum_out (where given) gets x + delta, out weight * (sum * rsqrt(mean(sum^2) + eps)).
HEADWAY_CLONES void norm_row_f32(const float* x, const float* delta, const float* weight, int64_t hidden, float eps,
                                 float* sum_out, float* out) {
  v16 squares = {};
  for (int64_t d0 = 0; d0 < hidden; d0 += kLanes) {
    const int64_t count = std::min(kLanes, hidden - d0);
    v16 s = load_f32(x + d0, count);
    if (delta != nullptr) {
      s = s + load_f32(delta + d0, count);
      store_f32(sum_out + d0, s, count);
    }
    squares = squares + s * s;
  }
  float lanes[kLanes];
  std::memcpy(lanes, &squares, sizeof(lanes));
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lanes[l] = lanes[l] + lanes[l + w];
  }
  const float r = 1.0f / std::sqrt(lanes[0] / static_cast<float>(hidden) + eps);
  const float* sums = delta != nullptr ? sum_out : x;
  for (int64_t d0 = 0; d0 < hidden; d0 += kLanes) {
    const int64_t count = std::min(kLanes, hidden - d0);
    store_f32(out + d0, load_f32(weight + d0, count) * (load_f32(sums + d0, count) * r), count);
  }
}

// rope_row for float32: out[d] = x[d] * cos[d] + x[d +- half] * sin[d].
HEADWAY_CLONES void rope_row_f32(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t side = 0; side < 2; ++side) {
    const int64_t self = side * half, partner = half - self;
    for (int64_t d0 = 0; d0 < half; d0 += kLanes) {
      const int64_t count = std::min(kLanes, half - d0), d = self + d0;
      store_f32(out + d,
                load_f32(x + d, count) * load_f32(cos + d, count) +
                    load_f32(x + partner + d0, count) * load_f32(sin + d, count),
                count);
    }
  }
}

// silu_mul_row for float32: silu(g) * up.
HEADWAY_CLONES void silu_mul_row_f32(const float* gate, const float* up, int64_t inter, float* out) {
  const v16 one = v16{} + 1.0f, zero = {};
  for (int64_t d0 = 0; d0 < inter; d0 += kLanes) {
    const int64_t count = std::min(kLanes, inter - d0);
    const v16 g = load_f32(gate + d0, count);
    const v16 e = exp_nonpositive_t<v16, v16i>(g < zero ? g : -g);
    store_f32(out + d0, g * (g < zero ? e : one) / (one + e) * load_f32(up + d0, count), count);
  }
}

// bf16(silu(g)) as a float for each of the 65,536 bf16 values g, computed once by silu_mul_row itself (times 1.0),
// so a lookup gives its bits: a prompt's rows take ~2.3x less time this way. Decoding steps' few rows keep
// computing it (a 256 KB table that the weights evict between layers would cost them cache misses).
const float* silu_table() {
  static const std::vector<float> table = [] {
    std::vector<uint16_t> all(65536), ones(65536, 0x3F80), out(65536);
    for (int64_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
    silu_mul_row(all.data(), ones.data(), 65536, out.data());
    std::vector<float> t(65536);
    for (int64_t i = 0; i < 65536; ++i) t[i] = bit_cast<float>(static_cast<uint32_t>(out[i]) << 16);
    return t;
  }();
  return table.data();
}

const uint16_t* bf16_data(const Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

uint16_t* bf16_data_mut(Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.stride(1) == 1, "fused ops: ", what,
              " must be bf16 rows [n, width] with contiguous rows");
}

}  // namespace

static std::tuple<Tensor, Tensor> add_rms_norm_f32(const Tensor& x_in, const std::optional<Tensor>& delta_in,
                                            const Tensor& weight_in, double eps) {
  const Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2, "fused ops: x must be rows [n, hidden]");
  const int64_t n = x.size(0), hidden = x.size(1);
  std::optional<Tensor> delta;
  if (delta_in.has_value()) {
    delta = delta_in->contiguous();
    TORCH_CHECK(delta->scalar_type() == at::kFloat && delta->sizes() == x.sizes(),
                "fused ops: delta must be float32 rows of x's shape");
  }
  const Tensor weight = weight_in.contiguous();
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == hidden,
              "fused ops: the norm weight must be [hidden] float32");
  Tensor out = at::empty_like(x);
  Tensor sum = delta.has_value() ? at::empty_like(x) : x;
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = delta.has_value() ? sum.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      norm_row_f32(xp + i * hidden, dp == nullptr ? nullptr : dp + i * hidden, wp, hidden, feps,
                   sp == nullptr ? nullptr : sp + i * hidden, op + i * hidden);
    }
  });
  return {sum, out};
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x_in, const std::optional<Tensor>& delta_in,
                                        const Tensor& weight_in, double eps) {
  if (x_in.scalar_type() == at::kFloat) return add_rms_norm_f32(x_in, delta_in, weight_in, eps);
  const Tensor x = x_in.contiguous();
  check_rows(x, "x");
  const int64_t n = x.size(0), hidden = x.size(1);
  std::optional<Tensor> delta;
  if (delta_in.has_value()) {
    delta = delta_in->contiguous();
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "fused ops: delta's shape is not x's");
  }
  const Tensor weight = weight_in.contiguous();
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.numel() == hidden,
              "fused ops: the norm weight must be [hidden] bf16");
  Tensor out = at::empty_like(x);
  Tensor sum = delta.has_value() ? at::empty_like(x) : x;
  const uint16_t* xp = bf16_data(x);
  const uint16_t* dp = delta.has_value() ? bf16_data(*delta) : nullptr;
  const uint16_t* wp = bf16_data(weight);
  uint16_t* sp = delta.has_value() ? bf16_data_mut(sum) : nullptr;
  uint16_t* op = bf16_data_mut(out);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    std::vector<float> tmp((hidden + kLanes - 1) / kLanes * kLanes);  // row's sums, whole blocks of 16
    for (int64_t i = b; i < e; ++i) {
      norm_row(xp + i * hidden, dp == nullptr ? nullptr : dp + i * hidden, wp, hidden, feps,
               sp == nullptr ? nullptr : sp + i * hidden, tmp.data(), op + i * hidden);
    }
  });
  return {sum, out};
}

static std::tuple<Tensor, Tensor, Tensor> rope_split_f32(const Tensor& qkv_in, const Tensor& cos_in,
                                                         const Tensor& sin_in, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const Tensor qkv = qkv_in.contiguous();
  const int64_t n = qkv.size(0), width = qkv.size(1);
  TORCH_CHECK(width == (heads + 2 * kv_heads) * head_dim && head_dim % 2 == 0,
              "fused ops: qkv's width is not (heads + 2 * kv_heads) * head_dim");
  const Tensor cos = cos_in.reshape({n, head_dim}).to(at::kFloat).contiguous();
  const Tensor sin = sin_in.reshape({n, head_dim}).to(at::kFloat).contiguous();
  Tensor q = at::empty({heads, n, head_dim}, qkv.options());
  Tensor k = at::empty({kv_heads, n, head_dim}, qkv.options());
  Tensor v = at::empty({kv_heads, n, head_dim}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* row = xp + i * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* dest = h < heads ? qp + (h * n + i) * head_dim : kp + ((h - heads) * n + i) * head_dim;
        rope_row_f32(row + h * head_dim, cp + i * head_dim, sp + i * head_dim, head_dim, dest);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy_n(row + (heads + kv_heads + h) * head_dim, head_dim, vp + (h * n + i) * head_dim);
      }
    }
  });
  return {q, k, v};
}

std::tuple<Tensor, Tensor, Tensor> rope_split(const Tensor& qkv_in, const Tensor& cos_in, const Tensor& sin_in,
                                              int64_t heads, int64_t kv_heads, int64_t head_dim) {
  if (qkv_in.scalar_type() == at::kFloat) return rope_split_f32(qkv_in, cos_in, sin_in, heads, kv_heads, head_dim);
  const Tensor qkv = qkv_in.contiguous();
  check_rows(qkv, "qkv");
  const int64_t n = qkv.size(0), width = qkv.size(1);
  TORCH_CHECK(width == (heads + 2 * kv_heads) * head_dim && head_dim % 2 == 0,
              "fused ops: qkv's width is not (heads + 2 * kv_heads) * head_dim");
  const Tensor cos = cos_in.reshape({n, head_dim}).contiguous(), sin = sin_in.reshape({n, head_dim}).contiguous();
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  Tensor q = at::empty({heads, n, head_dim}, qkv.options());
  Tensor k = at::empty({kv_heads, n, head_dim}, qkv.options());
  Tensor v = at::empty({kv_heads, n, head_dim}, qkv.options());
  const uint16_t *xp = bf16_data(qkv), *cp = bf16_data(cos), *sp = bf16_data(sin);
  uint16_t *qp = bf16_data_mut(q), *kp = bf16_data_mut(k), *vp = bf16_data_mut(v);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const uint16_t* row = xp + i * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        uint16_t* dest = h < heads ? qp + (h * n + i) * head_dim : kp + ((h - heads) * n + i) * head_dim;
        rope_row(row + h * head_dim, cp + i * head_dim, sp + i * head_dim, head_dim, dest);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::copy_n(row + (heads + kv_heads + h) * head_dim, head_dim, vp + (h * n + i) * head_dim);
      }
    }
  });
  return {q, k, v};
}

static Tensor silu_mul_f32(const Tensor& gate, const Tensor& up) {
  TORCH_CHECK(up.scalar_type() == at::kFloat && gate.dim() == 2 && gate.sizes() == up.sizes() &&
                  gate.stride(1) == 1 && up.stride(1) == 1,
              "fused ops: gate and up must be float32 rows of one shape");
  const int64_t n = gate.size(0), inter = gate.size(1);
  Tensor out = at::empty({n, inter}, gate.options());
  const float *gp = gate.data_ptr<float>(), *upp = up.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) silu_mul_row_f32(gp + i * gs, upp + i * us, inter, op + i * inter);
  });
  return out;
}

Tensor silu_mul(const Tensor& gate, const Tensor& up) {
  if (gate.scalar_type() == at::kFloat) return silu_mul_f32(gate, up);
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "fused ops: gate's shape is not up's");
  const int64_t n = gate.size(0), inter = gate.size(1);
  Tensor out = at::empty({n, inter}, gate.options());
  const uint16_t *gp = bf16_data(gate), *upp = bf16_data(up);
  const int64_t gs = gate.stride(0), us = up.stride(0);
  uint16_t* op = bf16_data_mut(out);
  if (n >= kTableRows) {
    const float* table = silu_table();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) silu_mul_row_table(gp + i * gs, upp + i * us, table, inter, op + i * inter);
    });
    return out;
  }
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) silu_mul_row(gp + i * gs, upp + i * us, inter, op + i * inter);
  });
  return out;
}

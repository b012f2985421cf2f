// Row-exact attention for the static engine's bf16/fp16 decoding steps (engine.RowAttention): each query row attends
// to the cache's first `start` slots and then its own tail of slots (its tree ancestors and itself, by depth), and its
// output depends only on its query and that sequence of keys and values. A one-token step and the same token's row in
// a tree therefore give the same bits, which is what keeps greedy speculative decoding equal to plain decoding.
//
// The arithmetic is fixed per output element, whatever the row count, the tree or the thread count:
//  - a score is q.k in four partial sums (dimension d into sum d % 4, each in order of d from 0.f), added as
//    (s0 + s1) + (s2 + s3), then times `scale`;
//  - softmax: the row's maximum, exp(s - max) by one polynomial, and their sum in 16 lanes (key j in lane j % 16)
//    folded in a fixed tree;
//  - the output is the sum of p_j * v_j[d] over the even keys j in order, plus the same over the odd keys, divided
//    by the sum.
// (Four and two partial sums: independent chains of additions that the CPU overlaps; one sum per output would wait on
// each addition's latency. Each step of a partial sum is one fused multiply-add in the FMA builds, below.)
// Threads split the work by output element (the prefix's keys for scores, then rows), never a sum.
//
// The shared prefix is where the time goes: its keys are transposed 16 at a time so that 16 scores are one vector
// operation per dimension, reused by every query of the key head, and a value row, once loaded, serves every query
// of its key head in the row. On CPUs with FMA (AVX-512, or AVX2 with FMA) the scores and the weighted values run as
// fused multiply-adds, in one build per vector width whose every lane computes the same fused operations (the same
// bits in either); elsewhere as a multiply and an add. A CPU always runs the same build, so its rows stay fixed.
// Softmax never contracts (the file's -ffp-contract=off): exp rounds as in the other kernels.
#include "row_attention.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

constexpr int64_t kMaxDim = 256;
constexpr int64_t kQueries = 4;  // queries scored together against one transposed block
// 16 floats, one per key of a block (or one per dimension of a value row): element-wise IEEE arithmetic on any x86
// target (GCC lowers it to one AVX-512 register, two AVX2 ones, or four SSE ones)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// Up to 16 keys (keys[l] for l < valid) transposed into kt [padded_dim(dim)][16]: kt[d * 16 + l] is dimension d of
// key l, zero past `valid` keys and past dim.
inline int64_t padded_dim(int64_t dim) { return (dim + 3) / 4 * 4; }

HEADWAY_CLONES void transpose_block(const float* const* keys, int64_t valid, int64_t dim, float* kt) {
  const int64_t padded = padded_dim(dim);
  if (valid < kLanes || padded > dim) std::fill(kt, kt + padded * kLanes, 0.f);
  for (int64_t l = 0; l < valid; ++l) {
    for (int64_t d = 0; d < dim; ++d) kt[d * kLanes + l] = keys[l][d];
  }
}

// Scores of `rows` x `group` queries against a transposed block of keys (`transpose_block`): query (i, h) reads
// q + i * row_stride + h * dim and writes its first `valid` scores to scores[(i * group + h) * score_stride + l].
// Every score of the kernel, prefix or tail, comes from here: the keys' order of arithmetic is one.
inline __attribute__((always_inline)) void score_block(
    const float* q, int64_t row_stride, int64_t rows, int64_t group, const float* kt_in, int64_t valid, int64_t dim,
    float scale, float* scores, int64_t score_stride) {
  const int64_t padded = padded_dim(dim);
  const int64_t queries = rows * group;
  const v16 vscale = v16{} + scale;
  for (int64_t first = 0; first < queries; first += kQueries) {
    const int64_t count = std::min(kQueries, queries - first);
    // the queries, read in place; where dim is not a multiple of 4, copied with zeros past dim (those dimensions
    // then add +-0 to sums that are never -0: no change)
    const float* qs[kQueries];
    float copies[kQueries][kMaxDim + 3];
    for (int64_t c = 0; c < kQueries; ++c) {
      const int64_t x = first + std::min(c, count - 1);
      qs[c] = q + (x / group) * row_stride + (x % group) * dim;
      if (padded > dim) {
        std::memcpy(copies[c], qs[c], dim * sizeof(float));
        std::fill(copies[c] + dim, copies[c] + padded, 0.f);
        qs[c] = copies[c];
      }
    }
    v16 s[kQueries][4] = {};
    for (int64_t d = 0; d < padded; d += 4) {
      for (int64_t r = 0; r < 4; ++r) {
        const v16 kd = load16(kt_in + (d + r) * kLanes);
        for (int64_t c = 0; c < kQueries; ++c) s[c][r] = s[c][r] + qs[c][d + r] * kd;
      }
    }
    for (int64_t c = 0; c < count; ++c) {
      const v16 res = ((s[c][0] + s[c][1]) + (s[c][2] + s[c][3])) * vscale;
      std::memcpy(scores + (first + c) * score_stride, &res, valid * sizeof(float));
    }
  }
}

// Softmax numerators of scores[0, length) in place (exp(s - max)); returns their sum. Key j's lane is j % 16: the
// whole blocks of 16 as vectors, the rest lane by lane (exp_nonpositive_t gives a lane the scalar's bits).
inline __attribute__((always_inline)) float softmax_numerators(float* scores, int64_t length) {
  const int64_t whole = length / kLanes * kLanes;
  v16 top = v16{} + scores[0];
  for (int64_t j = 0; j < whole; j += kLanes) {
    const v16 x = load16(scores + j);
    top = x > top ? x : top;
  }
  float lanes[kLanes];
  std::memcpy(lanes, &top, sizeof(lanes));
  for (int64_t l = 0; whole + l < length; ++l) lanes[l] = scores[whole + l] > lanes[l] ? scores[whole + l] : lanes[l];
  float m = lanes[0];
  for (int64_t l = 1; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  const v16 vm = v16{} + m;
  v16 total{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const v16 e = exp_nonpositive_t<v16, v16i>(load16(scores + j) - vm);
    std::memcpy(scores + j, &e, sizeof(e));
    total = total + e;
  }
  std::memcpy(lanes, &total, sizeof(lanes));
  for (int64_t l = 0; whole + l < length; ++l) {
    scores[whole + l] = exp_nonpositive(scores[whole + l] - m);
    lanes[l] = lanes[l] + scores[whole + l];
  }
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lanes[l] = lanes[l] + lanes[l + w];
  }
  return lanes[0];
}

// out[q][dim] = (sum over the even keys j in order of p[q][j] * value row j, plus the same over the odd keys) / sum[q]
// for Q queries that share their keys (the heads of one key head in one row: each value row is loaded once for all
// Q); key j is row j of v for j < start, then the tail's rows. W = dim / 16 vectors when dim is a multiple of 16
// (W > 0), else one dimension at a time. A query's arithmetic does not depend on Q.
template <int64_t W, int64_t Q>
inline __attribute__((always_inline)) void weighted_values(const float* const* p, const float* v, int64_t dim,
                                                           int64_t start, const int64_t* tail, int64_t tail_len,
                                                           const float* sum, float* const* out) {
  const int64_t length = start + tail_len;
  auto row = [&](int64_t j) { return v + (j < start ? j : tail[j - start]) * dim; };
  if constexpr (W > 0) {
    v16 even[Q][W] = {}, odd[Q][W] = {};
    int64_t j = 0;
    for (; j + 1 < length; j += 2) {
      const float *v0 = row(j), *v1 = row(j + 1);
      v16 a[W];
      for (int64_t c = 0; c < W; ++c) a[c] = load16(v0 + c * kLanes);
      for (int64_t x = 0; x < Q; ++x) {
        const v16 p0 = v16{} + p[x][j];
        for (int64_t c = 0; c < W; ++c) even[x][c] = even[x][c] + p0 * a[c];
      }
      for (int64_t c = 0; c < W; ++c) a[c] = load16(v1 + c * kLanes);
      for (int64_t x = 0; x < Q; ++x) {
        const v16 p1 = v16{} + p[x][j + 1];
        for (int64_t c = 0; c < W; ++c) odd[x][c] = odd[x][c] + p1 * a[c];
      }
    }
    if (j < length) {
      const float* v0 = row(j);
      for (int64_t x = 0; x < Q; ++x) {
        const v16 p0 = v16{} + p[x][j];
        for (int64_t c = 0; c < W; ++c) even[x][c] = even[x][c] + p0 * load16(v0 + c * kLanes);
      }
    }
    for (int64_t x = 0; x < Q; ++x) {
      const v16 vsum = v16{} + sum[x];
      for (int64_t c = 0; c < W; ++c) {
        const v16 o = (even[x][c] + odd[x][c]) / vsum;
        std::memcpy(out[x] + c * kLanes, &o, sizeof(v16));
      }
    }
  } else {
    for (int64_t x = 0; x < Q; ++x) {
      float acc[2][kMaxDim] = {};
      for (int64_t j = 0; j < length; ++j) {
        const float* vj = row(j);
        for (int64_t d = 0; d < dim; ++d) acc[j % 2][d] = acc[j % 2][d] + p[x][j] * vj[d];
      }
      for (int64_t d = 0; d < dim; ++d) out[x][d] = (acc[0][d] + acc[1][d]) / sum[x];
    }
  }
}

// The weighted values of `queries` queries sharing their keys, up to Q at a time.
template <int64_t W, int64_t Q>
inline __attribute__((always_inline)) void values_of(const float* const* p, const float* v, int64_t dim, int64_t start,
                                                     const int64_t* tail, int64_t tail_len, const float* sum,
                                                     float* const* out, int64_t queries) {
  int64_t x = 0;
  for (; x + Q <= queries; x += Q) weighted_values<W, Q>(p + x, v, dim, start, tail, tail_len, sum + x, out + x);
  for (; x < queries; ++x) weighted_values<W, 1>(p + x, v, dim, start, tail, tail_len, sum + x, out + x);
}

// Q: the queries whose accumulators (2 W vectors each) fit the registers beside a value row's W: 32 registers with
// AVX-512, 16 narrower ones otherwise.
template <int64_t Wide>
inline __attribute__((always_inline)) void values(const float* const* p, const float* v, int64_t dim, int64_t start,
                                                  const int64_t* tail, int64_t tail_len, const float* sum,
                                                  float* const* out, int64_t queries) {
  switch (dim) {
    case 64:
      return values_of<4, Wide ? 3 : 1>(p, v, dim, start, tail, tail_len, sum, out, queries);
    case 128:
      return values_of<8, 1>(p, v, dim, start, tail, tail_len, sum, out, queries);
    case 32:
      return values_of<2, Wide ? 6 : 2>(p, v, dim, start, tail, tail_len, sum, out, queries);
    case 16:
      return values_of<1, Wide ? 8 : 3>(p, v, dim, start, tail, tail_len, sum, out, queries);
    default:
      return values_of<0, 1>(p, v, dim, start, tail, tail_len, sum, out, queries);
  }
}

using ScoreFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float, float*,
                         int64_t);
using ValuesFn = void (*)(const float* const*, const float*, int64_t, int64_t, const int64_t*, int64_t, const float*,
                          float* const*, int64_t);

// One build of the two arithmetic kernels per kind of CPU: fused multiply-adds where the CPU has them.
#define HEADWAY_ROW_BUILD(NAME, ATTRS, WIDE)                                                                        \
  ATTRS void score_##NAME(const float* q, int64_t row_stride, int64_t rows, int64_t group, const float* kt,        \
                          int64_t valid, int64_t dim, float scale, float* scores, int64_t score_stride) {         \
    score_block(q, row_stride, rows, group, kt, valid, dim, scale, scores, score_stride);                        \
  }                                                                                                               \
  ATTRS void values_##NAME(const float* const* p, const float* v, int64_t dim, int64_t start, const int64_t* tail, \
                           int64_t tail_len, const float* sum, float* const* out, int64_t queries) {              \
    values<WIDE>(p, v, dim, start, tail, tail_len, sum, out, queries);                                           \
  }

HEADWAY_ROW_BUILD(base, , 0)
#if defined(__x86_64__) && defined(__GNUC__)
HEADWAY_ROW_BUILD(avx512, __attribute__((target("avx512f,fma"), optimize("fp-contract=fast"))), 1)
HEADWAY_ROW_BUILD(avx2, __attribute__((target("avx2,fma"), optimize("fp-contract=fast"))), 0)
#endif

struct RowBuild {
  ScoreFn score;
  ValuesFn values;
  const char* name;
};

// The build this CPU runs, or the one `isa` names (avx512, avx2, base: tests compare them); nullptr where it cannot.
const RowBuild* pick_row_build(const std::string& isa) {
  static const RowBuild base{score_base, values_base, "base"};
#if defined(__x86_64__) && defined(__GNUC__)
  static const RowBuild avx512{score_avx512, values_avx512, "avx512"};
  static const RowBuild avx2{score_avx2, values_avx2, "avx2"};
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "auto") return has512 ? &avx512 : has2 ? &avx2 : &base;
  if (isa == "avx512") return has512 ? &avx512 : nullptr;
  if (isa == "avx2") return has2 ? &avx2 : nullptr;
#else
  if (isa == "auto") return &base;
#endif
  return isa == "base" ? &base : nullptr;
}

// Softmax numerators of each query's scores in place; their sums into sum[x] (never contracted: see the top).
HEADWAY_CLONES void softmax_rows(float* const* scores, int64_t length, int64_t queries, float* sum) {
  for (int64_t x = 0; x < queries; ++x) sum[x] = softmax_numerators(scores[x], length);
}

}  // namespace

namespace {

at::Tensor run_row_attention(const RowBuild& build, const at::Tensor& q_in, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, int64_t start, const at::Tensor& tails_in,
                             const at::Tensor& lens_in, double scale_d, const std::optional<at::Tensor>& kt_cache,
                             int64_t kt_valid) {
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "row attention: the cache must be float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "row attention: the cache must be contiguous");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor tails = tails_in.to(at::kLong).contiguous(), lens = lens_in.to(at::kLong).contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv = k_cache.size(0), max_len = k_cache.size(1), m = tails.size(0), width = tails.size(1);
  TORCH_CHECK(dim <= kMaxDim, "row attention: head_dim above ", kMaxDim);
  TORCH_CHECK(heads % kv == 0 && m >= 1 && m <= rows && lens.size(0) == m, "row attention: shapes do not agree");
  const int64_t group = heads / kv, queries = m * group;  // queries of one key head
  const float scale = static_cast<float>(scale_d);
  const int64_t* tail = tails.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(len[i] <= width && start + len[i] <= max_len, "row attention: a tail past its slots");
    longest = std::max(longest, start + len[i]);
  }
  // scores[g][i][h][j]: key head g, row i, its query h of the group, key j
  std::unique_ptr<float[]> scores(new float[kv * queries * longest]);  // every entry read is written first
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // the prefix's keys transposed 16 at a time, kept in kt_cache [kv_heads, blocks, padded_dim, 16] where given:
  // blocks below kt_valid are read from it, complete blocks below start written to it
  const int64_t block_floats = padded_dim(dim) * kLanes;
  float* ktp = nullptr;
  int64_t kt_blocks = 0;
  if (kt_cache.has_value() && kt_cache->defined() && kt_cache->numel() > 0) {
    TORCH_CHECK(kt_cache->scalar_type() == at::kFloat && kt_cache->is_contiguous() && kt_cache->dim() == 4 &&
                    kt_cache->size(0) == kv && kt_cache->size(2) * kt_cache->size(3) == block_floats &&
                    kt_cache->size(1) * kLanes >= start,
                "row attention: the transposed key cache does not fit the cache");
    ktp = kt_cache->data_ptr<float>();
    kt_blocks = kt_cache->size(1);
  }
  // the prefix's scores: its keys 16 at a time against every row's queries of the key head (row i's heads
  // g * group .. (g + 1) * group are consecutive in q); items of equal work, so the threads finish together
  const int64_t blocks = (start + kLanes - 1) / kLanes;
  at::parallel_for(0, kv * blocks, 1, [&](int64_t b, int64_t e) {
    const float* keys[kLanes];
    alignas(64) float kt[(kMaxDim + 3) * kLanes];
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = item / blocks, block = item % blocks, j0 = block * kLanes;
      const int64_t valid = std::min(kLanes, start - j0);
      float* kept = ktp == nullptr ? nullptr : ktp + (g * kt_blocks + block) * block_floats;
      const float* block_kt = kept;
      if (kept == nullptr || j0 + kLanes > kt_valid) {
        for (int64_t l = 0; l < valid; ++l) keys[l] = kp + (g * max_len + j0 + l) * dim;
        transpose_block(keys, valid, dim, kt);
        block_kt = kt;
        if (kept != nullptr && valid == kLanes) std::memcpy(kept, kt, block_floats * sizeof(float));
      }
      build.score(qp + g * group * dim, heads * dim, m, group, block_kt, valid, dim, scale,
                  scores.get() + g * queries * longest + j0, longest);
    }
  });
  // then per row and key head: the tail's scores, the softmax and the weighted values of the row's queries of that
  // key head together (they share the row's keys and values)
  at::parallel_for(0, kv * m, 1, [&](int64_t b, int64_t e) {
    const float* keys[kLanes];
    alignas(64) float kt[(kMaxDim + 3) * kLanes];
    std::vector<float*> p(group), o(group);
    std::vector<float> sum(group);
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = item / m, i = item % m;
      float* row_scores = scores.get() + (g * queries + i * group) * longest;
      for (int64_t t0 = 0; t0 < len[i]; t0 += kLanes) {
        const int64_t valid = std::min(kLanes, len[i] - t0);
        for (int64_t l = 0; l < valid; ++l) keys[l] = kp + (g * max_len + tail[i * width + t0 + l]) * dim;
        transpose_block(keys, valid, dim, kt);
        build.score(qp + (i * heads + g * group) * dim, heads * dim, 1, group, kt, valid, dim, scale,
                    row_scores + start + t0, longest);
      }
      for (int64_t h = 0; h < group; ++h) {
        p[h] = row_scores + h * longest;
        o[h] = op + (i * heads + g * group + h) * dim;
      }
      softmax_rows(p.data(), start + len[i], group, sum.data());
      build.values(p.data(), vp + g * max_len * dim, dim, start, tail + i * width, len[i], sum.data(), o.data(),
                   group);
    }
  });
  for (int64_t i = m; i < rows; ++i) out[i].copy_(out[0]);
  return out.view({rows, heads * dim}).to(q_in.scalar_type());
}

}  // namespace

at::Tensor row_attention_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t start, const at::Tensor& tails, const at::Tensor& lens, double scale,
                                 const std::optional<at::Tensor>& kt_cache, int64_t kt_valid) {
  static const RowBuild* build = pick_row_build("auto");
  return run_row_attention(*build, q, k_cache, v_cache, start, tails, lens, scale, kt_cache, kt_valid);
}

at::Tensor row_attention_isa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             int64_t start, const at::Tensor& tails, const at::Tensor& lens, double scale,
                             const std::string& isa) {
  const RowBuild* build = pick_row_build(isa);
  TORCH_CHECK(build != nullptr, "row attention: this CPU has no ", isa, " build");
  return run_row_attention(*build, q, k_cache, v_cache, start, tails, lens, scale, std::nullopt, 0);
}

std::string row_attention_build() { return pick_row_build("auto")->name; }

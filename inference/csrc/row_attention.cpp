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
// each addition's latency.)
// Threads split the work by output element (keys for scores, query rows for the rest), never a sum.
//
// The shared prefix is where the time goes: its keys are transposed 16 at a time so that 16 scores are one vector
// operation per dimension, reused by every query of the key head. FMA contraction is off for this code (the build's
// -ffp-contract=off), so vector and scalar paths give the same bits.
#include "row_attention.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

constexpr int64_t kMaxDim = 256;
constexpr int64_t kQueries = 4;  // queries scored together against one transposed block
// 16 floats, one per key of a block (or one per dimension of a value row): element-wise IEEE arithmetic on any x86
// target (GCC lowers it to one AVX-512 register, two AVX2 ones, or four SSE ones)
typedef float v16 __attribute__((vector_size(64)));

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
HEADWAY_CLONES void score_block(
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

// Softmax numerators of scores[0, length) in place (exp(s - max)); returns their sum.
inline __attribute__((always_inline)) float softmax_numerators(float* scores, int64_t length) {
  float lanes[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = scores[0];
  int64_t j = 0;
  for (; j + kLanes <= length; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = scores[j + l] > lanes[l] ? scores[j + l] : lanes[l];
  }
  for (int64_t l = 0; j + l < length; ++l) lanes[l] = scores[j + l] > lanes[l] ? scores[j + l] : lanes[l];
  float m = lanes[0];
  for (int64_t l = 1; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = 0.f;
  for (j = 0; j + kLanes <= length; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      scores[j + l] = exp_nonpositive(scores[j + l] - m);
      lanes[l] = lanes[l] + scores[j + l];
    }
  }
  for (int64_t l = 0; j + l < length; ++l) {
    scores[j + l] = exp_nonpositive(scores[j + l] - m);
    lanes[l] = lanes[l] + scores[j + l];
  }
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lanes[l] = lanes[l] + lanes[l + w];
  }
  return lanes[0];
}

// out[dim] = (sum over the even keys j in order of p[j] * value row j, plus the same over the odd keys) / `sum`;
// key j is row j of v for j < start, then the tail's rows. W = dim / 16 vectors when dim is a multiple of 16 (W > 0),
// else one dimension at a time: the same bits.
template <int64_t W>
inline __attribute__((always_inline)) void weighted_values(const float* p, const float* v, int64_t dim, int64_t start,
                                                           const int64_t* tail, int64_t tail_len, float sum,
                                                           float* out) {
  const int64_t length = start + tail_len;
  auto row = [&](int64_t j) { return v + (j < start ? j : tail[j - start]) * dim; };
  if constexpr (W > 0) {
    v16 even[W] = {}, odd[W] = {};
    int64_t j = 0;
    for (; j + 1 < length; j += 2) {
      const v16 p0 = v16{} + p[j], p1 = v16{} + p[j + 1];
      const float *v0 = row(j), *v1 = row(j + 1);
      for (int64_t c = 0; c < W; ++c) {
        even[c] = even[c] + p0 * load16(v0 + c * kLanes);
        odd[c] = odd[c] + p1 * load16(v1 + c * kLanes);
      }
    }
    if (j < length) {
      const v16 p0 = v16{} + p[j];
      const float* v0 = row(j);
      for (int64_t c = 0; c < W; ++c) even[c] = even[c] + p0 * load16(v0 + c * kLanes);
    }
    const v16 vsum = v16{} + sum;
    for (int64_t c = 0; c < W; ++c) {
      const v16 o = (even[c] + odd[c]) / vsum;
      std::memcpy(out + c * kLanes, &o, sizeof(v16));
    }
  } else {
    float acc[2][kMaxDim] = {};
    for (int64_t j = 0; j < length; ++j) {
      const float* vj = row(j);
      for (int64_t d = 0; d < dim; ++d) acc[j % 2][d] = acc[j % 2][d] + p[j] * vj[d];
    }
    for (int64_t d = 0; d < dim; ++d) out[d] = (acc[0][d] + acc[1][d]) / sum;
  }
}

// One query row after its scores (scores[0, start + tail_len)): the softmax and the weighted values into out[dim].
HEADWAY_CLONES void finish_row(
    const float* v, int64_t dim, int64_t start, const int64_t* tail, int64_t tail_len, float* scores, float* out) {
  const float sum = softmax_numerators(scores, start + tail_len);
  switch (dim) {
    case 64:
      return weighted_values<4>(scores, v, dim, start, tail, tail_len, sum, out);
    case 128:
      return weighted_values<8>(scores, v, dim, start, tail, tail_len, sum, out);
    case 32:
      return weighted_values<2>(scores, v, dim, start, tail, tail_len, sum, out);
    case 16:
      return weighted_values<1>(scores, v, dim, start, tail, tail_len, sum, out);
    default:
      return weighted_values<0>(scores, v, dim, start, tail, tail_len, sum, out);
  }
}

}  // namespace

at::Tensor row_attention_forward(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t start, const at::Tensor& tails_in, const at::Tensor& lens_in, double scale_d,
                                 const std::optional<at::Tensor>& kt_cache, int64_t kt_valid) {
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
  // scores: the prefix's keys 16 at a time against every row's queries of the key head (row i's heads
  // g * group .. (g + 1) * group are consecutive in q), then each row's tail against its own queries
  const int64_t blocks = (start + kLanes - 1) / kLanes, tail_blocks = (width + kLanes - 1) / kLanes;
  const int64_t prefix_items = kv * blocks;
  at::parallel_for(0, prefix_items + kv * m * tail_blocks, 1, [&](int64_t b, int64_t e) {
    const float* keys[kLanes];
    alignas(64) float kt[(kMaxDim + 3) * kLanes];
    for (int64_t item = b; item < e; ++item) {
      if (item < prefix_items) {
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
        score_block(qp + g * group * dim, heads * dim, m, group, block_kt, valid, dim, scale,
                    scores.get() + g * queries * longest + j0, longest);
        continue;
      }
      const int64_t rest = item - prefix_items, g = rest / (m * tail_blocks);
      const int64_t i = (rest / tail_blocks) % m, t0 = (rest % tail_blocks) * kLanes;
      const int64_t valid = std::min(kLanes, len[i] - t0);
      if (valid <= 0) continue;
      for (int64_t l = 0; l < valid; ++l) keys[l] = kp + (g * max_len + tail[i * width + t0 + l]) * dim;
      transpose_block(keys, valid, dim, kt);
      score_block(qp + (i * heads + g * group) * dim, heads * dim, 1, group, kt, valid, dim, scale,
                  scores.get() + (g * queries + i * group) * longest + start + t0, longest);
    }
  });
  at::parallel_for(0, kv * queries, 1, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t g = item / queries, i = (item % queries) / group, h = item % group;
      const int64_t head = g * group + h;
      finish_row(vp + g * max_len * dim, dim, start, tail + i * width, len[i],
                 scores.get() + (g * queries + i * group + h) * longest, op + (i * heads + head) * dim);
    }
  });
  for (int64_t i = m; i < rows; ++i) out[i].copy_(out[0]);
  return out.view({rows, heads * dim}).to(q_in.scalar_type());
}

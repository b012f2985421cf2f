// Picks from logit rows: greedy decoding's first largest logit, and a drafter's k most likely tokens with their log
// probabilities. ATen's index-returning reductions (max along a dimension, argmax, topk) ran one element at a time on
// CPUs: ~100-200 us for a 49,152-token bf16 row against ~15 us for amax, paid on every token of a greedy walk and on
// every level of a draft tree. Here each row is read in 16-lane blocks: a block whose largest value cannot enter the
// result is skipped after one vector compare.
#include "row_select.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using at::Tensor;

namespace {

constexpr int64_t kLanes = 16;
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

// 16 values of a row from p as floats (bf16 exactly), `fill` past count
template <typename T>
inline __attribute__((always_inline)) v16 load16(const T* p, int64_t count, float fill) {
  v16 out;
  if constexpr (std::is_same_v<T, float>) {
    if (count == kLanes) {  // a whole block: one fixed-size copy, i.e. one vector load
      std::memcpy(&out, p, sizeof(out));
      return out;
    }
    out = v16{} + fill;
    std::memcpy(&out, p, count * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    v16h h = {};
    if (count == kLanes) {
      std::memcpy(&h, p, sizeof(h));
      return bit_cast<v16>(__builtin_convertvector(h, v16u) << 16);
    }
    std::memcpy(&h, p, count * sizeof(uint16_t));
    const v16 f = bit_cast<v16>(__builtin_convertvector(h, v16u) << 16);
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    out = lane < static_cast<int32_t>(count) ? f : v16{} + fill;
  }
  return out;
}

// The first index of the largest value of p[0, n) (of the first NaN where there is one, as torch's max does).
template <typename T>
inline __attribute__((always_inline)) int64_t first_max_t(const T* p, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  v16 best = v16{} + lowest;
  v16i nan = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    const v16 x = load16(p + i, std::min(kLanes, n - i), lowest);
    nan |= x != x;
    best = x > best ? x : best;
  }
  bool any_nan = false;
  float m = lowest;
  for (int64_t l = 0; l < kLanes; ++l) {
    any_nan |= nan[l] != 0;
    m = std::max(m, best[l]);
  }
  for (int64_t i = 0; i < n; i += kLanes) {  // the first block that holds it, then its first lane
    const int64_t count = std::min(kLanes, n - i);
    const v16 x = load16(p + i, count, lowest);
    const v16i hit = any_nan ? x != x : x == m;
    for (int64_t l = 0; l < count; ++l) {
      if (hit[l]) return i + l;
    }
  }
  return 0;  // every value -inf: the first
}

// A row's k largest values (ties: the lower index first), largest first, as a sorted insertion list.
struct TopK {
  int64_t k;
  std::vector<float> val;
  std::vector<int64_t> idx;
  explicit TopK(int64_t k_) : k(k_) {
    val.reserve(k + 1);
    idx.reserve(k + 1);
  }
  float floor() const { return static_cast<int64_t>(val.size()) < k ? -std::numeric_limits<float>::infinity() : val.back(); }
  bool full() const { return static_cast<int64_t>(val.size()) == k; }
  void offer(float x, int64_t i) {  // indices arrive in increasing order, so an equal value ranks after
    if (full() && !(x > val.back())) return;
    int64_t at = static_cast<int64_t>(val.size());
    while (at > 0 && x > val[at - 1]) --at;
    val.insert(val.begin() + at, x);
    idx.insert(idx.begin() + at, i);
    if (static_cast<int64_t>(val.size()) > k) {
      val.pop_back();
      idx.pop_back();
    }
  }
};

// The k largest of p[0, n), less log(sum(exp(p - max))) + max: their log probabilities, largest first (ties: the lower
// index first). A row without a finite largest value (NaN, all -inf) gives NaN values.
template <typename T>
inline __attribute__((always_inline)) void top_logprobs_t(const T* p, int64_t n, int64_t k, float* out_val, int64_t* out_idx) {
  const float lowest = -std::numeric_limits<float>::infinity();
  TopK top(k);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t count = std::min(kLanes, n - i);
    const v16 x = load16(p + i, count, lowest);
    const float floor = top.floor();
    bool enters = !top.full();
    for (int64_t l = 0; l < kLanes && !enters; ++l) enters = x[l] > floor;
    if (!enters) continue;
    for (int64_t l = 0; l < count; ++l) top.offer(x[l], i + l);
  }
  const float m = top.val[0];
  float lse = m;
  if (std::isfinite(m)) {
    v16 sum = {};
    for (int64_t i = 0; i < n; i += kLanes) {
      const v16 x = load16(p + i, std::min(kLanes, n - i), lowest);
      // exp of -inf (padding, masked tokens) is below the polynomial's range: clamp to exp(-87), then zero it
      const v16 e = exp_nonpositive_t<v16, v16i>(x - m);
      sum += x == lowest ? v16{} : e;
    }
    float s = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) s += sum[l];
    lse = m + std::log(s);
  } else {
    lse = std::numeric_limits<float>::quiet_NaN();
  }
  for (int64_t j = 0; j < k; ++j) {
    out_val[j] = top.val[j] - lse;
    out_idx[j] = top.idx[j];
  }
}

// One build per CPU kind (HEADWAY_CLONES) of each row function per dtype.
HEADWAY_CLONES int64_t first_max_row(const float* p, int64_t n) { return first_max_t(p, n); }
HEADWAY_CLONES int64_t first_max_row(const c10::BFloat16* p, int64_t n) { return first_max_t(p, n); }
HEADWAY_CLONES void top_logprobs_row(const float* p, int64_t n, int64_t k, float* v, int64_t* i) {
  top_logprobs_t(p, n, k, v, i);
}
HEADWAY_CLONES void top_logprobs_row(const c10::BFloat16* p, int64_t n, int64_t k, float* v, int64_t* i) {
  top_logprobs_t(p, n, k, v, i);
}

void check_rows(const Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU rows only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, what, ": rows [n, V] with V >= 1");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16 rows");
}

// f(data pointer of x's dtype, row) for every row of x, the rows split over the threads
template <typename F>
void for_rows(const Tensor& x, const F& f) {
  const auto run = [&](const auto* p) {
    at::parallel_for(0, x.size(0), 2, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) f(p, r);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>());
  } else {
    run(x.data_ptr<c10::BFloat16>());
  }
}

}  // namespace

Tensor first_max(const Tensor& logits) {
  check_rows(logits, "first_max");
  const Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for_rows(x, [&](const auto* p, int64_t r) { o[r] = first_max_row(p + r * n, n); });
  return out;
}

std::tuple<Tensor, Tensor> top_logprobs(const Tensor& logits, int64_t k) {
  check_rows(logits, "top_logprobs");
  const Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "top_logprobs: k=", k, " outside 1..", n);
  Tensor values = at::empty({rows, k}, x.options().dtype(at::kFloat));
  Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  for_rows(x, [&](const auto* p, int64_t r) { top_logprobs_row(p + r * n, n, k, v + r * k, ix + r * k); });
  return {values, indices};
}

// float32 linears for decoding steps, streamed from the weight as loaded (target.linear_weights=stream). A one-token
// step of a float32 target reads every weight once and does two flops per float read, so its linears are a memory
// stream, best read as one sequential stream that the hardware prefetchers follow. Each thread reads one contiguous
// block of the weight's rows: one weight row after another for a few rows of x, and for more rows four weight rows
// at a time, shared by four rows of x while they are in the first-level cache. Every output element is one fixed
// sequence of fused multiply-adds over 16 lanes and a fixed reduction that depend on its own row and weight row
// alone, so neither the row count, the other rows, the thread count nor the CPU's vector width (AVX-512 or AVX2)
// changes a bit: a tree's rows stay one-token steps. Prompts (many rows) are better read in cache blocks:
// `StreamLinear` gives them to at::linear.
// bf16 targets have their own kernel below, over a packed copy of the weight: vdpbf16ps on CPUs with AVX512-BF16,
// the same order in float32 fused multiply-adds on AVX2 ones.
// Narrow headers, not <torch/extension.h>: that one alone takes about 20 s to compile on 2 cores, and this
// extension is built on a user's first `headway demo`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

using at::Tensor;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGrain = 64;  // outputs per task, at least

// 16 lanes of float: one AVX-512 register (v16), or two AVX2 ones (v16x2: GCC lowers a 64-byte vector type poorly
// where the widest registers are 32 bytes). Either computes the same fused multiply-adds per lane.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

struct v16x2 {
  v8 lo, hi;  // lanes 0-7, 8-15
};

inline __attribute__((always_inline)) v16x2 operator+(v16x2 a, v16x2 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline __attribute__((always_inline)) v16x2 operator*(v16x2 a, v16x2 b) { return {a.lo * b.lo, a.hi * b.hi}; }

// p[0, count) as 16 lanes, zero past count (a zero lane adds fma(0, 0, acc) = acc)
template <typename V>
inline __attribute__((always_inline)) V load(const float* p, int64_t count) {
  static_assert(sizeof(V) == kLanes * sizeof(float), "16 lanes");
  V v{};
  std::memcpy(&v, p, count * sizeof(float));
  return v;
}

template <typename V>
inline __attribute__((always_inline)) V load_whole(const float* p) {
  if constexpr (std::is_same_v<V, v16x2>) {  // each half by itself
    v8 lo, hi;
    std::memcpy(&lo, p, sizeof(lo));
    std::memcpy(&hi, p + 8, sizeof(hi));
    return V{lo, hi};
  } else {
    V v;
    std::memcpy(&v, p, sizeof(v));  // a fixed-size copy: one vector load
    return v;
  }
}

// the 16 lanes' sum in a fixed tree (lane l with l + 8, then + 4, + 2, + 1), plus the bias
template <typename V>
inline __attribute__((always_inline)) float finish(V acc, float bias) {
  float a[kLanes];
  std::memcpy(a, &acc, sizeof(a));
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
  }
  return a[0] + bias;
}

// One level of `finish`'s tree for two vectors at once (lanes [0, W) of each group of 2W lanes plus lanes [W, 2W)):
// the result's lanes are a's group sums, then b's.
template <int W, typename F, typename I, int L>
inline __attribute__((always_inline)) F fold_lanes(F a, F b) {
  I lo, hi;
  for (int l = 0; l < L; ++l) {
    lo[l] = l / W * 2 * W + l % W;
    hi[l] = l / W * 2 * W + W + l % W;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

template <int W>
inline __attribute__((always_inline)) v16 fold(v16 a, v16 b) {
  return fold_lanes<W, v16, v16i, 16>(a, b);
}

// v16x2: the same sums; for W < 8 each half of the result folds one input's two halves
template <int W>
inline __attribute__((always_inline)) v16x2 fold(v16x2 a, v16x2 b) {
  if constexpr (W == 8) {
    return {a.lo + a.hi, b.lo + b.hi};
  } else {
    return {fold_lanes<W, v8, v8i, 8>(a.lo, a.hi), fold_lanes<W, v8, v8i, 8>(b.lo, b.hi)};
  }
}

// `finish` of 16 accumulators at once: lane q of the result is acc[q]'s sum, by the same additions in the same tree
// (so the same bits), 15 vector additions instead of 240 scalar ones.
template <typename V>
inline __attribute__((always_inline)) V finish16(const V* acc) {
  V c[8], d[4], e[2];
  for (int p = 0; p < 8; ++p) c[p] = fold<8>(acc[2 * p], acc[2 * p + 1]);
  for (int p = 0; p < 4; ++p) d[p] = fold<4>(c[2 * p], c[2 * p + 1]);
  for (int p = 0; p < 2; ++p) e[p] = fold<2>(d[2 * p], d[2 * p + 1]);
  return fold<1>(e[0], e[1]);
}

// `finish16` of the first N accumulators (the rest zero), skipping the additions of zeros alone: the same bits in
// lanes [0, N) in fewer vector additions (5 instead of 15 for 4).
template <int N, typename V>
inline __attribute__((always_inline)) V finish_n(const V* acc) {
  static_assert(N >= 1 && N <= 16, "1 to 16 accumulators");
  V c[8] = {}, d[4] = {}, e[2] = {};
  const V zero{};
  for (int p = 0; p < (N + 1) / 2; ++p) c[p] = fold<8>(acc[2 * p], 2 * p + 1 < N ? acc[2 * p + 1] : zero);
  for (int p = 0; p < (N + 3) / 4; ++p) d[p] = fold<4>(c[2 * p], c[2 * p + 1]);
  for (int p = 0; p < (N + 7) / 8; ++p) e[p] = fold<2>(d[2 * p], d[2 * p + 1]);
  return fold<1>(e[0], e[1]);
}

// Outputs [o, o + NO) of rows [r, r + NR): acc = acc + w * x lane by lane over the inputs, contracted to a fused
// multiply-add (the callers' fp-contract=fast), then `finish` (`finish16` where the tile has 3 to 16, padded with
// zero accumulators, whose sums are dropped). The order of the loops only changes which loads come first, never an
// output's sequence of operations. SEQ: one weight row's whole sum after another, so the tile reads its weight as one
// sequential stream, which the hardware prefetchers follow best (a few rows); else all NO weight rows block by block,
// each block used by every row of the tile (more rows: fewer loads per multiply-add).
// The shared-block tiles (many rows) prefetch the weight this many floats (16 KB) ahead into the first-level cache;
// 4 to 16 KB read trees of 8 to 24 rows 10-20% faster on the AVX512-BF16 EPYC (1 and 2 threads), 2 KB no faster.
// The sequential tiles need none: the hardware prefetchers follow their one stream (a hint made them slower).
constexpr int64_t kAhead = 4096;

template <typename V, int NO, int NR, bool SEQ>
inline __attribute__((always_inline)) void tile(const float* x, int64_t r, const float* w, int64_t in, int64_t o,
                                                const float* bias, float* y, int64_t out) {
  V acc[NR * NO >= 3 ? 16 : NR * NO] = {};  // acc[i * NO + j]: row r + i, output o + j
  const int64_t whole = in / kLanes * kLanes, tail = in - whole;  // whole blocks of 16 inputs, then the partial one
  if constexpr (SEQ) {
#pragma GCC unroll 8
    for (int j = 0; j < NO; ++j) {
      const float* wj = w + (o + j) * in;
      for (int64_t k = 0; k < whole; k += kLanes) {
        const V wv = load_whole<V>(wj + k);
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) acc[i * NO + j] = acc[i * NO + j] + wv * load_whole<V>(x + (r + i) * in + k);
      }
      if (tail > 0) {
        const V wv = load<V>(wj + whole, tail);
        for (int i = 0; i < NR; ++i) acc[i * NO + j] = acc[i * NO + j] + wv * load<V>(x + (r + i) * in + whole, tail);
      }
    }
  } else {
    const float* w_end = w + out * in;
    for (int64_t k = 0; k < whole; k += kLanes) {  // the accumulators stay in registers
      if (r == 0) {  // the first row tile of these weight rows fetches the ones ahead (one line per row per block)
#pragma GCC unroll 4
        for (int j = 0; j < NO; ++j) {
          const float* p = w + (o + j) * in + k + kAhead;
          if (p < w_end) __builtin_prefetch(p, 0, 3);
        }
      }
      V wv[NO];
#pragma GCC unroll 4
      for (int j = 0; j < NO; ++j) wv[j] = load_whole<V>(w + (o + j) * in + k);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        const V xv = load_whole<V>(x + (r + i) * in + k);
#pragma GCC unroll 4
        for (int j = 0; j < NO; ++j) acc[i * NO + j] = acc[i * NO + j] + wv[j] * xv;
      }
    }
    if (tail > 0) {
      V wv[NO];
      for (int j = 0; j < NO; ++j) wv[j] = load<V>(w + (o + j) * in + whole, tail);
      for (int i = 0; i < NR; ++i) {
        const V xv = load<V>(x + (r + i) * in + whole, tail);
        for (int j = 0; j < NO; ++j) acc[i * NO + j] = acc[i * NO + j] + wv[j] * xv;
      }
    }
  }
  if constexpr (NR * NO >= 3) {
    float sums[kLanes];
    const V all = finish16(acc);
    std::memcpy(sums, &all, sizeof(sums));
    for (int i = 0; i < NR; ++i) {
      for (int j = 0; j < NO; ++j) y[(r + i) * out + o + j] = sums[i * NO + j] + (bias == nullptr ? 0.0f : bias[o + j]);
    }
  } else {
    for (int i = 0; i < NR; ++i) {
      for (int j = 0; j < NO; ++j) {
        y[(r + i) * out + o + j] = finish(acc[i * NO + j], bias == nullptr ? 0.0f : bias[o + j]);
      }
    }
  }
}

// Outputs [o, o + NO) of every row, in tiles of RB rows (the last tile shorter).
template <typename V, int NO, int RB, bool SEQ>
inline __attribute__((always_inline)) void outputs(const float* x, int64_t rows, const float* w, int64_t in,
                                                   int64_t o, const float* bias, float* y, int64_t out) {
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) tile<V, NO, RB, SEQ>(x, r, w, in, o, bias, y, out);
  switch (rows - r) {
    case 3:
      if constexpr (RB > 3) tile<V, NO, 3, SEQ>(x, r, w, in, o, bias, y, out);
      break;
    case 2:
      if constexpr (RB > 2) tile<V, NO, 2, SEQ>(x, r, w, in, o, bias, y, out);
      break;
    case 1:
      if constexpr (RB > 1) tile<V, NO, 1, SEQ>(x, r, w, in, o, bias, y, out);
      break;
    default:
      break;
  }
}

// Outputs [begin, end) of every row: NO weight rows at a time, then one at a time, in tiles of RB rows, at most 16
// accumulators (AVX-512 has 32 registers; AVX2's 16 hold 8 of them, two registers each, and the rest spill to the
// first-level cache, which still streamed the weight faster than fewer).
template <typename V, int NO, int RB, bool SEQ>
inline __attribute__((always_inline)) void block(const float* x, int64_t rows, const float* w, int64_t in,
                                                 int64_t begin, int64_t end, const float* bias, float* y,
                                                 int64_t out) {
  int64_t o = begin;
  for (; o + NO <= end; o += NO) outputs<V, NO, RB, SEQ>(x, rows, w, in, o, bias, y, out);
  for (; o < end; ++o) outputs<V, 1, RB, SEQ>(x, rows, w, in, o, bias, y, out);
}

// Calls of up to this many rows read the weight one row after another (`tile`'s SEQ) on AVX-512; more rows share each
// block of 4 weight rows among 4 rows of x. On the AVX512-BF16 EPYC (1 and 2 threads) the sequential read streamed the
// default target's weights up to 1.5x faster for 1 to 6 rows, and slower from 8 (docs/benchmarks.md).
constexpr int64_t kSeqRows = 6;

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,fma"), optimize("fp-contract=fast"))) void block_avx512(
    const float* x, int64_t rows, const float* w, int64_t in, int64_t begin, int64_t end, const float* bias, float* y,
    int64_t out) {
  if (rows == 1) {
    block<v16, 4, 1, true>(x, rows, w, in, begin, end, bias, y, out);
  } else if (rows <= kSeqRows) {
    block<v16, 8, 2, true>(x, rows, w, in, begin, end, bias, y, out);
  } else {
    block<v16, 4, 4, false>(x, rows, w, in, begin, end, bias, y, out);
  }
}

__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void block_avx2(
    const float* x, int64_t rows, const float* w, int64_t in, int64_t begin, int64_t end, const float* bias, float* y,
    int64_t out) {
  block<v16x2, 4, 2, true>(x, rows, w, in, begin, end, bias, y, out);
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// bf16 rows times bf16 weights (a bf16 target's decoding steps) on CPUs with AVX512-BF16: each output is one fixed
// sequence of `vdpbf16ps` over 32 inputs at a time (16 float lanes, each adding two products a step), then `finish`'s
// fixed tree and the bias, rounded once to bf16. The sequence depends on the output's own row and weight row alone, as
// in the float32 kernel, so neither the row count nor the thread count changes a bit; a tree's rows cost little beside
// the first (a vdpbf16ps does 32 multiply-adds, and every row shares each weight load), where fbgemm's float16 kernel
// does 16 float32 ones after converting the weight.
constexpr int kGroup = 4;  // outputs a bf16 tile computes together: the packed weight's groups
// How far ahead a bf16 call prefetches the packed weight, in bf16 values (8 KB, in whole groups; 4 to 32 KB streamed
// the default target's weights alike on an AVX512-BF16 EPYC, 2 threads), into the second-level cache. Each tile of a
// call of several row tiles prefetches its share of the group ahead, so that the memory keeps streaming while a
// group's later tiles compute on weights already in the first-level cache.
constexpr int64_t kPrefetch = 4096;
struct Prefetch {
  const char* base;   // this tile's share of a group ahead
  int64_t bytes;      // its size
  int64_t per_block;  // cache lines to prefetch each block of 32 inputs
};

// Where a call's row tiles prefetch a packed group's successor: each of `tiles` tiles over a group prefetches its share
// of the group `ahead` groups on, spread over the blocks of 32 inputs (the AVX-512 and AVX2 bf16 blocks alike).
struct GroupPrefetch {
  int64_t group_bytes, ahead, share, per_block;
  GroupPrefetch(int64_t blocks, int64_t tiles)
      : group_bytes(blocks * kGroup * 2 * kLanes * 2),
        ahead(std::max<int64_t>(1, (kPrefetch * 2 + group_bytes - 1) / group_bytes)),
        share(((group_bytes + tiles - 1) / tiles + 63) / 64 * 64),
        per_block((share / 64 + blocks - 1) / blocks) {}
  Prefetch part(const uint16_t* group, int64_t tile) const {
    const char* next = reinterpret_cast<const char*>(group) + ahead * group_bytes;
    const int64_t start = std::min(tile * share, group_bytes);
    return Prefetch{next + start, std::min(share, group_bytes - start), per_block};
  }
};

// lanes[i * kGroup + j]: output o + j's bias, zero past the last output or without one
inline void bias_lanes(const float* bias, int64_t o, int64_t out, float* lanes) {
  for (int q = 0; q < kLanes; ++q) lanes[q] = bias != nullptr && o + q % kGroup < out ? bias[o + q % kGroup] : 0.0f;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")
#include <immintrin.h>

inline __attribute__((always_inline)) __m512bh load_bf16(const uint16_t* p, int64_t count) {
  return (__m512bh)_mm512_maskz_loadu_epi16(count >= 32 ? ~0u : ((1u << count) - 1u), p);
}

// Outputs [o, o + kGroup) of rows [r, r + NR) over the weight packed by `pack_bf16` ([groups of kGroup outputs,
// blocks of 32 inputs, kGroup, 32], zero-padded), so that a tile reads one sequential stream (the prefetchers then run
// ahead of it; the weight as loaded has a stream per row). `bias`: lane i * kGroup + j holds output o + j's.
template <int NR>
inline __attribute__((always_inline)) void tile_bf16(const uint16_t* x, int64_t r, const uint16_t* group,
                                                     int64_t blocks, int64_t in, int64_t o, __m512 bias,
                                                     uint16_t* y, int64_t out, Prefetch pf) {
  constexpr int NO = kGroup;
  __m512 acc[NR * NO];
#pragma GCC unroll 16
  for (int a = 0; a < NR * NO; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k = kb * 2 * kLanes, count = std::min<int64_t>(2 * kLanes, in - k);
    const uint16_t* p = group + kb * NO * 2 * kLanes;
    for (int64_t l = 0; l < pf.per_block; ++l) {
      const int64_t off = (kb * pf.per_block + l) * 64;
      if (off < pf.bytes) __builtin_prefetch(pf.base + off, 0, 1);
    }
    __m512bh wv[NO];
#pragma GCC unroll 4
    for (int j = 0; j < NO; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(p + j * 2 * kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const __m512bh xv = load_bf16(x + (r + i) * in + k, count);
#pragma GCC unroll 4
      for (int j = 0; j < NO; ++j) acc[i * NO + j] = _mm512_dpbf16_ps(acc[i * NO + j], wv[j], xv);
    }
  }
  v16 sum[NR * NO];
#pragma GCC unroll 16
  for (int a = 0; a < NR * NO; ++a) sum[a] = (v16)acc[a];
  // lane i * NO + j: row r + i, output o + j; plus its bias, rounded to bf16 (to nearest even) in one instruction
  const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps((__m512)finish_n<NR * NO>(sum), bias));
  uint16_t out16[kLanes];
  std::memcpy(out16, &rounded, sizeof(out16));
  for (int i = 0; i < NR; ++i) {
    if (o + NO <= out) {
      std::memcpy(y + (r + i) * out + o, out16 + i * NO, NO * sizeof(uint16_t));
    } else {
      for (int j = 0; o + j < out; ++j) y[(r + i) * out + o + j] = out16[i * NO + j];
    }
  }
}

// Output groups [begin, end) of every row, in tiles of 4 rows (the last tile shorter; 4 x 4 accumulators, 4 weight
// vectors and an input vector in AVX-512's 32 registers).
void block_bf16(const uint16_t* x, int64_t rows, const uint16_t* packed, int64_t blocks, int64_t in, int64_t begin,
                int64_t end, const float* bias, uint16_t* y, int64_t out) {
  const GroupPrefetch plan(blocks, (rows + 3) / 4);
  for (int64_t g = begin; g < end; ++g) {
    const uint16_t* group = packed + g * blocks * kGroup * 2 * kLanes;
    const int64_t o = g * kGroup;
    float lanes[kLanes];
    bias_lanes(bias, o, out, lanes);
    const __m512 bias_v = _mm512_loadu_ps(lanes);
    int64_t r = 0, t = 0;
    auto part = [&](int64_t tile) { return plan.part(group, tile); };
    for (; r + 4 <= rows; r += 4, ++t) tile_bf16<4>(x, r, group, blocks, in, o, bias_v, y, out, part(t));
    switch (rows - r) {
      case 3:
        tile_bf16<3>(x, r, group, blocks, in, o, bias_v, y, out, part(t));
        break;
      case 2:
        tile_bf16<2>(x, r, group, blocks, in, o, bias_v, y, out, part(t));
        break;
      case 1:
        tile_bf16<1>(x, r, group, blocks, in, o, bias_v, y, out, part(t));
        break;
      default:
        break;
    }
  }
}
#pragma GCC pop_options
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// bf16 rows times the same packed bf16 weights on CPUs with AVX2 and FMA but no AVX512-BF16: each output follows
// vdpbf16ps's documented order in float32 fused multiply-adds (a lane adds its odd input's product, then its even
// one's; a product of two bf16 values is exact in float32, so the fused and the unfused sum agree), then the same
// `finish` tree, the bias and one rounding to bf16 (to nearest even). A call reads half the bytes of the float32
// kernel; a row's bits depend on its own row and weight row alone, so no row count or thread count changes them.
// vdpbf16ps also flushes denormal inputs and sums to zero, which this build does not: the builds may part there.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

// rows of x [rows, in] bf16 as float32 in the kernel's order: per row and block of 32 inputs, the odd inputs of
// lanes 0-7 (inputs 1, 3, ..., 15), their even ones (0, 2, ..., 14), then the same for lanes 8-15 (inputs 16-31);
// zero past `in`. The tile then reads each row's operands straight from the first-level cache.
void split_bf16_rows(const uint16_t* x, int64_t rows, int64_t in, int64_t blocks, float* xs) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * in;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      float* dst = xs + (r * blocks + kb) * 2 * kLanes;
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 8; ++l) {
          const int64_t k = kb * 2 * kLanes + h * kLanes + 2 * l;
          const uint32_t even = k < in ? uint32_t(row[k]) << 16 : 0u, odd = k + 1 < in ? uint32_t(row[k + 1]) << 16 : 0u;
          std::memcpy(dst + h * kLanes + l, &odd, sizeof(float));
          std::memcpy(dst + h * kLanes + 8 + l, &even, sizeof(float));
        }
      }
    }
  }
}

// float32 lanes rounded to bf16 (to nearest even; a NaN stays a quiet NaN), as vcvtneps2bf16 rounds
inline __attribute__((always_inline)) __m256i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// Outputs [o, o + kGroup) of rows [r, r + NR), as `tile_bf16` computes them: 16 lanes as two AVX2 registers, each
// lane one chain of fused multiply-adds (odd input, then even, block by block).
template <int NR>
inline __attribute__((always_inline)) void tile_bf16_avx2(const float* xs, int64_t r, const uint16_t* group,
                                                          int64_t blocks, int64_t o, const float* bias,
                                                          uint16_t* y, int64_t out, Prefetch pf) {
  constexpr int NO = kGroup;
  const __m256i odd_mask = _mm256_set1_epi32(int32_t(0xffff0000u));
  __m256 acc[NR * NO][2];  // [row i * NO + output j][lanes 0-7, 8-15]
#pragma GCC unroll 16
  for (int a = 0; a < NR * NO; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    for (int64_t l = 0; l < pf.per_block; ++l) {
      const int64_t off = (kb * pf.per_block + l) * 64;
      if (off < pf.bytes) __builtin_prefetch(pf.base + off, 0, 1);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const uint16_t* p = group + kb * NO * 2 * kLanes + h * kLanes;
#pragma GCC unroll 4
      for (int j = 0; j < NO; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * 2 * kLanes));
        const __m256 w_odd = _mm256_castsi256_ps(_mm256_and_si256(w, odd_mask));
        const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) {
          const float* xp = xs + ((r + i) * blocks + kb) * 2 * kLanes + h * kLanes;
          acc[i * NO + j][h] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(xp), acc[i * NO + j][h]);
          acc[i * NO + j][h] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(xp + 8), acc[i * NO + j][h]);
        }
      }
    }
  }
  v16x2 sum[NR * NO];
#pragma GCC unroll 16
  for (int a = 0; a < NR * NO; ++a) sum[a] = {(v8)acc[a][0], (v8)acc[a][1]};
  const v16x2 all = finish_n<NR * NO>(sum);
  const __m256i lo = round_bf16(_mm256_add_ps((__m256)all.lo, _mm256_loadu_ps(bias)));
  const __m256i hi = round_bf16(_mm256_add_ps((__m256)all.hi, _mm256_loadu_ps(bias + 8)));
  uint32_t out32[kLanes];
  std::memcpy(out32, &lo, sizeof(lo));
  std::memcpy(out32 + 8, &hi, sizeof(hi));
  for (int i = 0; i < NR; ++i) {
    for (int j = 0; j < NO && o + j < out; ++j) y[(r + i) * out + o + j] = uint16_t(out32[i * NO + j]);
  }
}

// Output groups [begin, end) of every row from rows split by `split_bf16_rows`, in tiles of kRowsAvx2 rows (the last
// tile shorter), prefetching as `block_bf16` does.
// Rows per tile: 2 x 4 outputs x 2 registers fill AVX2's 16 registers and spill a few to the first-level cache; on the
// AVX2 EPYC that read the default target's weights 1.2-1.5x faster for 4 to 16 rows than 1 or 3 rows a tile, and than
// two passes of lanes 0-7 then 8-15 (8 accumulators, no spills) for every row count (docs/benchmarks.md).
constexpr int kRowsAvx2 = 2;

void block_bf16_avx2(const float* xs, int64_t rows, const uint16_t* packed, int64_t blocks, int64_t begin,
                     int64_t end, const float* bias, uint16_t* y, int64_t out) {
  const GroupPrefetch plan(blocks, (rows + kRowsAvx2 - 1) / kRowsAvx2);
  for (int64_t g = begin; g < end; ++g) {
    const uint16_t* group = packed + g * blocks * kGroup * 2 * kLanes;
    const int64_t o = g * kGroup;
    float lanes[kLanes];
    bias_lanes(bias, o, out, lanes);
    int64_t r = 0, t = 0;
    auto part = [&](int64_t tile) { return plan.part(group, tile); };
    for (; r + kRowsAvx2 <= rows; r += kRowsAvx2, ++t) {
      tile_bf16_avx2<kRowsAvx2>(xs, r, group, blocks, o, lanes, y, out, part(t));
    }
    switch (rows - r) {
      case 3:
        if constexpr (kRowsAvx2 > 3) tile_bf16_avx2<3>(xs, r, group, blocks, o, lanes, y, out, part(t));
        break;
      case 2:
        if constexpr (kRowsAvx2 > 2) tile_bf16_avx2<2>(xs, r, group, blocks, o, lanes, y, out, part(t));
        break;
      case 1:
        if constexpr (kRowsAvx2 > 1) tile_bf16_avx2<1>(xs, r, group, blocks, o, lanes, y, out, part(t));
        break;
      default:
        break;
    }
  }
}
#pragma GCC pop_options
#endif

using Block = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, const float*, float*, int64_t);

// The widest build this CPU runs, or the one `isa` names (avx512, avx2; tests compare them); none: no build here.
Block pick_block(const std::string& isa = "auto") {
#if defined(__x86_64__) && defined(__GNUC__)
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && (isa == "auto" || isa == "avx512")) return block_avx512;
  if (avx2 && (isa == "auto" || isa == "avx2")) return block_avx2;
#endif
  return nullptr;
}

Tensor run_stream(const Tensor& x_in, const Tensor& weight, const std::optional<Tensor>& bias, Block run) {
  TORCH_CHECK(run != nullptr, "stream_linear: this CPU has neither AVX-512 nor AVX2 with FMA");
  const Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2 &&
                  weight.dim() == 2 && weight.is_contiguous() && x.size(1) == weight.size(1),
              "stream_linear: x [m, in] and weight [out, in] float32, the weight contiguous");
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out && bias->is_contiguous(),
                "stream_linear: bias [out] float32");
    bp = bias->data_ptr<float>();
  }
  Tensor y = at::empty({rows, out}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, kGrain, [&](int64_t b, int64_t e) { run(xp, rows, wp, in, b, e, bp, yp, out); });
  return y;
}

// The bf16 build this CPU runs: "avx512bf16" (vdpbf16ps), "avx2" (float32 fused multiply-adds), or "" (none).
std::string bf16_build() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512bf16")) {
    return "avx512bf16";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#endif
  return "";
}

bool bf16_supported() { return !bf16_build().empty(); }

// [out, in] bf16 -> [ceil(out / kGroup), ceil(in / 32), kGroup, 32], zero-padded (block_bf16's layout)
Tensor pack_bf16(const Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "stream_linear: pack a [out, in] bf16 weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t groups = (out + kGroup - 1) / kGroup, blocks = (in + 2 * kLanes - 1) / (2 * kLanes);
  Tensor padded = at::zeros({groups * kGroup, blocks * 2 * kLanes}, weight.options());
  padded.slice(0, 0, out).slice(1, 0, in).copy_(weight);
  return padded.view({groups, kGroup, blocks, 2 * kLanes}).permute({0, 2, 1, 3}).contiguous();
}

// x [m, in] bf16 times a weight packed by `pack_bf16` for [out, in], through the bf16 build `build` names
Tensor run_bf16_build(const Tensor& x_in, const Tensor& packed, const std::optional<Tensor>& bias, int64_t out,
                      const std::string& build) {
  TORCH_CHECK(build == "avx512bf16" || build == "avx2", "stream_linear: bf16 rows need a CPU with AVX512-BF16, or AVX2 with FMA");
  const Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kGroup &&
                  packed.size(3) == 2 * kLanes && packed.size(1) == (x.size(1) + 2 * kLanes - 1) / (2 * kLanes) &&
                  packed.size(0) == (out + kGroup - 1) / kGroup,
              "stream_linear_bf16: x [m, in] bfloat16 and a weight packed by stream_pack_bf16 for [out, in]");
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(1), groups = packed.size(0);
  Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out, "stream_linear_bf16: bias [out]");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  Tensor y = at::empty({rows, out}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if defined(__x86_64__) && defined(__GNUC__)
  if (build == "avx512bf16") {
    at::parallel_for(0, groups, kGrain / kGroup,
                     [&](int64_t b0, int64_t e0) { block_bf16(xp, rows, wp, blocks, in, b0, e0, bp, yp, out); });
  } else {
    Tensor split = at::empty({rows, blocks * 2 * kLanes}, x.options().dtype(at::kFloat));
    float* xs = split.data_ptr<float>();
    split_bf16_rows(xp, rows, in, blocks, xs);
    at::parallel_for(0, groups, kGrain / kGroup,
                     [&](int64_t b0, int64_t e0) { block_bf16_avx2(xs, rows, wp, blocks, b0, e0, bp, yp, out); });
  }
#endif
  return y;
}

Tensor run_stream_bf16(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t out) {
  static const std::string build = bf16_build();
  return run_bf16_build(x, packed, bias, out, build);
}

}  // namespace

bool stream_linear_available() { return pick_block() != nullptr; }

// x [m, in] float32, weight [out, in] float32 contiguous, bias [out] or none: x @ weight^T + bias [m, out].
Tensor stream_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  static const Block run = pick_block();
  return run_stream(x, weight, bias, run);
}

// The op the C++ layer loop calls through the dispatcher (it is another extension) and Python through torch.ops.
TORCH_LIBRARY(headway_kernels, m) {
  m.def("stream_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("stream_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out) -> Tensor");
  m.def("stream_pack_bf16(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(headway_kernels, CPU, m) {
  m.impl("stream_linear", &stream_linear);
  m.impl("stream_linear_bf16", &run_stream_bf16);
  m.impl("stream_pack_bf16", &pack_bf16);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &stream_linear_available, "whether this CPU runs stream_linear");
  m.def("bf16_available", &bf16_supported, "whether this CPU runs stream_linear over bf16 rows");
  m.def("bf16_build", &bf16_build, "the bf16 build this CPU runs: avx512bf16, avx2, or empty (none)");
  m.def(
      "stream_linear_isa",
      [](const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, const std::string& isa) {
        const Block run = pick_block(isa);
        TORCH_CHECK(run != nullptr, "stream_linear: this CPU has no ", isa, " build");
        return run_stream(x, weight, bias, run);
      },
      "stream_linear through one build (avx512, avx2), for tests");
  m.def(
      "stream_linear_bf16_isa",
      [](const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t out,
         const std::string& isa) {
        TORCH_CHECK(isa == bf16_build() || (isa == "avx2" && !bf16_build().empty()), "stream_linear: this CPU has no ",
                    isa, " bf16 build");
        return run_bf16_build(x, packed, bias, out, isa);
      },
      "stream_linear_bf16 through one build (avx512bf16, avx2), for tests");
}

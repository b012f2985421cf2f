// float32 linears for decoding steps, streamed from the weight as loaded (target.linear_weights=stream). A one-token
// step of a float32 target reads every weight once and does two flops per float read, so its linears are a memory
// stream; oneDNN's and MKL's float32 kernels read the default target's weights at about 16 GB/s with two threads of a machine that streams about 25.
// Here each thread reads one contiguous block of the weight's rows, four rows at a time, and a tree's rows share each
// weight row while it is in the first-level cache. Every output element is one fixed sequence of fused multiply-adds
// over 16 lanes and a fixed reduction that depend on its own row and weight row alone, so neither the row count, the
// other rows, the thread count nor the CPU's vector width (AVX-512 or AVX2) changes a bit: a tree's rows stay
// one-token steps. Prompts (many rows) are better read in cache blocks: `StreamLinear` gives them to at::linear.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

using at::Tensor;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kOuts = 4;  // weight rows (outputs) per pass: independent chains of multiply-adds
constexpr int64_t kGrain = 64;  // outputs per task, at least

// 16 lanes: one AVX-512 register or two AVX2 ones, the same fused multiply-adds per lane in either build
typedef float v16 __attribute__((vector_size(64)));

// x[0, count) as a vector, zero past count: a zero lane adds fma(0, 0, acc) = acc
inline __attribute__((always_inline)) v16 load(const float* p, int64_t count) {
  v16 v = {};
  if (count == kLanes) {  // a whole block: one fixed-size copy, i.e. one vector load
    std::memcpy(&v, p, sizeof(v));
  } else {
    std::memcpy(&v, p, count * sizeof(float));
  }
  return v;
}

// the lanes' sum in a fixed tree (lane l with l + 8, then + 4, + 2, + 1), plus the bias
inline __attribute__((always_inline)) float finish(v16 acc, float bias) {
  float a[kLanes];
  std::memcpy(a, &acc, sizeof(a));
  for (int64_t w = kLanes / 2; w >= 1; w /= 2) {
    for (int64_t l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
  }
  return a[0] + bias;
}

// Outputs [o, o + NO) of rows [r, r + NR): acc = acc + w * x lane by lane over the inputs, contracted to a fused
// multiply-add (the callers' fp-contract=fast), then `finish`.
template <int NO, int NR>
inline __attribute__((always_inline)) void tile(const float* x, int64_t r, const float* w, int64_t in, int64_t o,
                                                const float* bias, float* y, int64_t out) {
  v16 acc[NO][NR] = {};
  for (int64_t k = 0; k < in; k += kLanes) {
    const int64_t count = std::min(kLanes, in - k);
    v16 wv[NO];
    for (int j = 0; j < NO; ++j) wv[j] = load(w + (o + j) * in + k, count);
    for (int i = 0; i < NR; ++i) {
      const v16 xv = load(x + (r + i) * in + k, count);
      for (int j = 0; j < NO; ++j) acc[j][i] = acc[j][i] + wv[j] * xv;
    }
  }
  for (int j = 0; j < NO; ++j) {
    for (int i = 0; i < NR; ++i) y[(r + i) * out + o + j] = finish(acc[j][i], bias == nullptr ? 0.0f : bias[o + j]);
  }
}

// Outputs [o, o + NO) of every row, in blocks of RB rows (the last block shorter).
template <int NO, int RB>
inline __attribute__((always_inline)) void outputs(const float* x, int64_t rows, const float* w, int64_t in,
                                                   int64_t o, const float* bias, float* y, int64_t out) {
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) tile<NO, RB>(x, r, w, in, o, bias, y, out);
  switch (rows - r) {
    case 3:
      tile<NO, 3>(x, r, w, in, o, bias, y, out);
      break;
    case 2:
      tile<NO, 2>(x, r, w, in, o, bias, y, out);
      break;
    case 1:
      tile<NO, 1>(x, r, w, in, o, bias, y, out);
      break;
    default:
      break;
  }
}

// Outputs [begin, end) of every row: kOuts weight rows at a time, then one at a time. RB: rows per tile, as many as
// the registers hold (four with AVX-512's 32, two with AVX2's 16).
template <int RB>
inline __attribute__((always_inline)) void block(const float* x, int64_t rows, const float* w, int64_t in,
                                                 int64_t begin, int64_t end, const float* bias, float* y,
                                                 int64_t out) {
  int64_t o = begin;
  for (; o + kOuts <= end; o += kOuts) outputs<kOuts, RB>(x, rows, w, in, o, bias, y, out);
  for (; o < end; ++o) outputs<1, RB>(x, rows, w, in, o, bias, y, out);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f,fma"), optimize("fp-contract=fast"))) void block_avx512(
    const float* x, int64_t rows, const float* w, int64_t in, int64_t begin, int64_t end, const float* bias, float* y,
    int64_t out) {
  block<4>(x, rows, w, in, begin, end, bias, y, out);
}

__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) void block_avx2(
    const float* x, int64_t rows, const float* w, int64_t in, int64_t begin, int64_t end, const float* bias, float* y,
    int64_t out) {
  block<2>(x, rows, w, in, begin, end, bias, y, out);
}
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

}  // namespace

bool stream_linear_available() { return pick_block() != nullptr; }

// x [m, in] float32, weight [out, in] float32 contiguous, bias [out] or none: x @ weight^T + bias [m, out].
Tensor stream_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  static const Block run = pick_block();
  return run_stream(x, weight, bias, run);
}

// The op the C++ layer loop calls through the dispatcher (it is another extension) and Python through torch.ops.
TORCH_LIBRARY(headway_kernels, m) { m.def("stream_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(headway_kernels, CPU, m) { m.impl("stream_linear", &stream_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &stream_linear_available, "whether this CPU runs stream_linear");
  m.def(
      "stream_linear_isa",
      [](const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, const std::string& isa) {
        const Block run = pick_block(isa);
        TORCH_CHECK(run != nullptr, "stream_linear: this CPU has no ", isa, " build");
        return run_stream(x, weight, bias, run);
      },
      "stream_linear through one build (avx512, avx2), for tests");
}

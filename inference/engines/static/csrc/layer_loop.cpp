// The static engine's decoder stack as one C++ call: the ATen ops `engine.layer_step` and `engine.decoder_stack`
// run, in the same order with the same arguments (so the same bits), without Python between them. A decoding
// step of the default target makes about a thousand small calls, and the Python around each costs more than the
// kernel on a CPU. bf16 steps can instead take `run_fused`, whose element-wise work is fused_ops.cpp's kernels
// (`target.fused_ops`). Built on first use by `inference/engines/static/layer_loop.py`.
// Narrow headers, not <torch/extension.h>: that one alone takes about 20 s to compile on 2 cores, and this
// extension is built on a user's first `headway demo`.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/stack.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/utils/pybind.h>

#include "fused_ops.h"
#include "prompt_attention.h"
#include "row_attention.h"
#include "row_select.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

using at::Tensor;

namespace {

// How a linear's weights run (the formats of `target.linear_weights` the loop supports).
enum Kind : int64_t { kNative = 0, kOneDNN = 1, kMKL = 2, kStream = 3, kFP16 = 4 };

struct Linear {
  int64_t kind;
  Tensor weight;  // native, MKL (its fallback for other row counts) and stream: [out, in] (bf16 stream: or empty)
  Tensor packed;  // oneDNN and MKL: the prepacked weight; float16 and bf16 stream: the bf16 weight prepacked for
                  // oneDNN (prompts), or empty; float32 stream: the weight as loaded for oneDNN's prompts, or empty
  std::optional<Tensor> bias;  // float16: the oneDNN copy's (fbgemm's packed weight holds its own)
  int64_t rows;  // oneDNN: pad fewer rows to this many; MKL: the row count its weight was packed for; stream: the
                 // most rows its float32 kernel takes, or bf16's output count; float16: bf16 calls of up to this many
                 // rows go in row-exact chunks
  c10::IValue extra;  // float16: fbgemm's packed weight (bias included); stream: bf16's weight packed for its kernel
  double scale;      // float16: the power of two its bf16 weight was multiplied by to fit float16
};

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

Tensor boxed(const c10::OperatorHandle& handle, torch::jit::Stack stack) {
  handle.callBoxed(&stack);
  return stack[0].toTensor();
}

// packed_onednn.onednn_linear, fewer rows than `pad` padded with copies of the first
Tensor onednn_rows(const Linear& l, Tensor x, int64_t pad) {
  static const c10::OperatorHandle handle = op("mkldnn::_linear_pointwise");
  const int64_t rows = x.size(0);
  if (rows == 1 && pad > 1) {
    x = x.expand({pad, -1});
  } else if (rows < pad) {
    x = at::cat({x, x.slice(0, 0, 1).expand({pad - rows, -1})});
  }
  c10::IValue bias = l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue();
  Tensor y = boxed(handle, {x, l.packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                            std::string("")});
  return y.slice(0, 0, rows);
}

Tensor onednn(const Linear& l, const Tensor& x) { return onednn_rows(l, x, l.rows); }

// packed_onednn.BF16_PROMPT_ROWS: bf16 calls of this many rows or more take the oneDNN copy of a float16 linear
constexpr int64_t kBF16PromptRows = 128;

// packed_mkl.mkl_linear
Tensor mkl(const Linear& l, const Tensor& x) {
  static const c10::OperatorHandle handle = op("mkl::_mkl_linear");
  c10::IValue bias = l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue();
  return boxed(handle, {x, l.packed, l.weight, bias, l.rows});
}

// packed_stream.stream_linear and stream_bf16: the streaming kernels are another extension's ops
// (target/csrc/stream_linear.cpp). bf16 (`extra` holds the kernel's packed weight, `rows` the output count): calls of
// fewer than kBF16PromptRows rows through it, prompts on the oneDNN copy (`packed`) or in float32 over the weight as
// loaded; float32: calls of up to `rows` rows over the weight as loaded, more (prompts) through oneDNN over it where
// `packed` holds it.
Tensor stream(const Linear& l, const Tensor& x) {
  if (l.extra.isTensor()) {
    if (x.size(0) >= kBF16PromptRows) {
      if (l.packed.numel() > 0) return onednn_rows(l, x, 1);
      // packed_stream._float32_prompt: no oneDNN bf16 kernels here, so float32 over a copy of the weight
      const std::optional<Tensor> bias32 =
          l.bias.has_value() ? std::optional<Tensor>(l.bias->to(at::kFloat)) : std::nullopt;
      return at::linear(x.to(at::kFloat), l.weight.to(at::kFloat), bias32).to(at::kBFloat16);
    }
    static const c10::OperatorHandle bf16 = op("headway_kernels::stream_linear_bf16");
    c10::IValue bias = l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue();
    return boxed(bf16, {x, l.extra, bias, l.rows});
  }
  if (x.scalar_type() != at::kFloat || l.weight.scalar_type() != at::kFloat) {
    return at::linear(x, l.weight, l.bias);
  }
  if (x.size(0) > l.rows) {
    return l.packed.numel() > 0 ? onednn_rows(l, x, 1) : at::linear(x, l.weight, l.bias);
  }
  static const c10::OperatorHandle handle = op("headway_kernels::stream_linear");
  c10::IValue bias = l.bias.has_value() ? c10::IValue(*l.bias) : c10::IValue();
  return boxed(handle, {x, l.weight, bias});
}

// packed_float16.fp16_linear: fbgemm's float16 kernel in float32; bf16 rows converted in and out, in chunks of 3 to 6
// rows (packed_fbgemm.fbgemm_chunked) where this CPU's kernel gives a row bits that depend on the row count
Tensor fp16(const Linear& l, const Tensor& x) {
  static const c10::OperatorHandle handle = op("quantized::linear_dynamic_fp16");
  if (x.scalar_type() == at::kFloat) {
    return boxed(handle, {x, l.extra});
  }
  if (l.packed.numel() > 0 && x.size(0) >= kBF16PromptRows) {
    return onednn_rows(l, x, 1);
  }
  const Tensor xf = x.to(at::kFloat);
  const int64_t rows = xf.size(0), least = 3, most = 6;
  Tensor y;
  if (rows > l.rows) {
    y = boxed(handle, {xf, l.extra});
  } else if (rows < least) {
    y = boxed(handle, {at::cat({xf, xf.slice(0, 0, 1).expand({least - rows, -1})}), l.extra}).slice(0, 0, rows);
  } else if (rows <= most) {
    y = boxed(handle, {xf, l.extra});
  } else {
    const int64_t chunks = (rows + most - 1) / most;
    std::vector<Tensor> parts;
    for (int64_t i = 0, start = 0; i < chunks; ++i) {
      const int64_t size = rows / chunks + (i < rows % chunks ? 1 : 0);
      parts.push_back(boxed(handle, {xf.slice(0, start, start + size), l.extra}));
      start += size;
    }
    y = at::cat(parts);
  }
  return (l.scale == 1.0 ? y : y.mul_(l.scale)).to(x.scalar_type());
}

Tensor linear(const Linear& l, const Tensor& x) {
  switch (l.kind) {
    case kFP16:
      return fp16(l, x);
    case kOneDNN:
      return onednn(l, x);
    case kMKL:
      return mkl(l, x);
    case kStream:
      return stream(l, x);
    default:
      return at::linear(x, l.weight, l.bias);
  }
}

// engine._rms_norm_fn's lean norm (transformers' arithmetic)
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor xf = x.to(at::kFloat);
  return weight * (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

// RowAttention's plan: `kernel` (row_attention.cpp, over the prefix length and each row's tail slots and length),
// or SDPA per group: the rows' order, whether it is 0..n-1, the gathered slots, and the groups of rows (count, key
// length, read in place).
struct RowPlan {
  bool kernel;
  int64_t start;
  int64_t kt_valid;  // the transposed key blocks (the loop's `kts`) are current for the first kt_valid slots
  Tensor tails, lens;
  Tensor order;
  bool in_order;
  std::optional<Tensor> slots;
  std::vector<std::tuple<int64_t, int64_t, bool>> groups;
};

// engine._row_attention
Tensor row_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const RowPlan& plan,
                     double scale, const std::optional<Tensor>& kt) {
  if (plan.kernel) {
    return row_attention_forward(q, k_cache, v_cache, plan.start, plan.tails, plan.lens, scale, kt, plan.kt_valid);
  }
  const int64_t kv_heads = k_cache.size(0), head_dim = k_cache.size(-1);
  Tensor k_all, v_all;
  if (plan.slots.has_value()) {
    k_all = k_cache.index_select(1, *plan.slots).to(at::kFloat);
    v_all = v_cache.index_select(1, *plan.slots).to(at::kFloat);
  }
  Tensor q_all = (plan.in_order ? q : q.index_select(0, plan.order)).unsqueeze(2).to(at::kFloat);
  std::vector<Tensor> outs;
  int64_t slot = 0, row = 0;
  for (const auto& [b, length, in_place] : plan.groups) {
    Tensor k, v;
    if (in_place) {
      k = k_cache.slice(1, 0, length).unsqueeze(0).to(at::kFloat);
      v = v_cache.slice(1, 0, length).unsqueeze(0).to(at::kFloat);
    } else {
      k = k_all.slice(1, slot, slot + b * length).view({kv_heads, b, length, head_dim}).transpose(0, 1);
      v = v_all.slice(1, slot, slot + b * length).view({kv_heads, b, length, head_dim}).transpose(0, 1);
      slot += b * length;
    }
    outs.push_back(at::scaled_dot_product_attention(q_all.slice(0, row, row + b), k, v, {}, 0.0, false, scale,
                                                    true));
    row += b;
  }
  Tensor out = (outs.size() == 1 ? outs[0] : at::cat(outs)).view({q.size(0), -1});
  if (!plan.in_order) {
    out = at::empty_like(out).index_copy_(0, plan.order, out);
  }
  return out.to(q.scalar_type());
}

// (kind, weight, packed, bias, rows, fbgemm's packed float16 weight or None, its scale)
using Spec = std::tuple<int64_t, Tensor, Tensor, std::optional<Tensor>, int64_t, py::object, double>;
// A layer's projections: qkv (one fused linear, or q, k, v), o, the MLP's (one fused gate_up, or gate and up), down.
using LayerSpec = std::tuple<std::vector<Spec>, Spec, std::vector<Spec>, Spec>;

Linear to_linear(const Spec& s) {
  const auto& [kind, weight, packed, bias, rows, extra, scale] = s;
  // fbgemm's packed weight is a TorchScript object (torch.ScriptObject), the bf16 streaming kernel's a tensor; the
  // dispatcher takes either as an IValue
  c10::IValue held;
  if (THPVariable_Check(extra.ptr())) {
    held = c10::IValue(extra.cast<Tensor>());
  } else if (!extra.is_none()) {
    held = c10::IValue(extra.cast<torch::jit::Object>()._ivalue());
  }
  TORCH_CHECK(kind != kFP16 || held.isObject(), "layer loop: a float16 linear without its packed weight");
  return Linear{kind, weight, packed, bias, rows, held, scale};
}

struct Layer {
  std::vector<Linear> qkv;
  Linear o;
  std::vector<Linear> mlp;
  Linear down;
};

// What a layer's family adds to the Llama layer (engine_step.LayerPlan): Qwen3's RMSNorm over each query and key
// head before the rotary (weights [head_dim] and their eps; none for other families), and whether the layer rotates
// at all (SmolLM3's NoPE layers do not).
struct HeadNorms {
  std::optional<Tensor> q_norm, k_norm;
  double q_eps = 0.0, k_eps = 0.0;
  bool rope = true;
};
// (q_norm, k_norm, q_eps, k_eps, rope)
using HeadSpec = std::tuple<std::optional<Tensor>, std::optional<Tensor>, double, double, bool>;

class LayerLoop {
 public:
  // Per layer: its two norm weights and eps, its linears (LayerSpec, each as (kind, weight, packed, bias, rows)), and
  // its family's additions (HeadSpec; none: every layer a Llama layer).
  LayerLoop(std::vector<Tensor> norms1, std::vector<Tensor> norms2, std::vector<double> eps1,
            std::vector<double> eps2,
            std::vector<LayerSpec> layers, Tensor final_norm, double final_eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
            int64_t inter, double scale, std::vector<HeadSpec> head_specs)
      : norms1_(std::move(norms1)),
        norms2_(std::move(norms2)),
        eps1_(std::move(eps1)),
        eps2_(std::move(eps2)),
        final_norm_(std::move(final_norm)),
        final_eps_(final_eps),
        heads_(heads),
        kv_(kv_heads),
        hd_(head_dim),
        inter_(inter),
        scale_(scale) {
    TORCH_CHECK(layers.size() == norms1_.size(), "layer loop: one LayerSpec per layer");
    for (const auto& [qkv, o, mlp, down] : layers) {
      Layer layer{{}, to_linear(o), {}, to_linear(down)};
      for (const auto& s : qkv) layer.qkv.push_back(to_linear(s));
      for (const auto& s : mlp) layer.mlp.push_back(to_linear(s));
      TORCH_CHECK((layer.qkv.size() == 1 || layer.qkv.size() == 3) && (layer.mlp.size() == 1 || layer.mlp.size() == 2),
                  "layer loop: qkv is 1 or 3 linears, the MLP 1 or 2");
      layers_.push_back(std::move(layer));
    }
    TORCH_CHECK(head_specs.empty() || head_specs.size() == layers_.size(), "layer loop: one HeadSpec per layer");
    for (size_t i = 0; i < layers_.size(); ++i) {
      HeadNorms h;
      if (!head_specs.empty()) {
        std::tie(h.q_norm, h.k_norm, h.q_eps, h.k_eps, h.rope) = head_specs[i];
        TORCH_CHECK(h.q_norm.has_value() == h.k_norm.has_value(), "layer loop: a q norm without a k norm");
      }
      heads_norms_.push_back(std::move(h));
    }
  }

  // engine.decoder_stack over rows x [n, hidden]: the normed output [n, hidden] and, with `hidden`, the layers'
  // inputs and output (the last one normed). Attention reads slots [0, end) under `mask`, or by the RowAttention
  // plan when `row_plan` is set (`kts`: the kernel's transposed keys per layer, or none); `causal`: through the
  // kernel's causal path (a prompt at the cache's start); `attn_dtype`: the dtype that attention (not the row plan's)
  // runs in, else the cache's. `fused` (bf16 rows): `run_fused`.
  std::tuple<Tensor, std::vector<Tensor>> run(Tensor x, const Tensor& cos, const Tensor& sin,
                                              const std::vector<Tensor>& ks, const std::vector<Tensor>& vs,
                                              const std::vector<Tensor>& kts, const Tensor& slots, int64_t end,
                                              const std::optional<Tensor>& mask, bool causal,
                                              const std::optional<RowPlan>& row_plan, bool hidden,
                                              std::optional<at::ScalarType> attn_dtype, bool fused,
                                              bool prompt_kernel) const {
    if (fused) {
      TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                  "layer loop: the fused kernels take bf16 or float32 rows");
      TORCH_CHECK(!prompt_kernel || x.scalar_type() == at::kFloat || prompt_attention_available() ||
                      prompt_attention_f32_available(),
                  "layer loop: no brgemm for a bf16 prompt's attention");
      return run_fused(x, cos, sin, ks, vs, kts, slots, end, mask, causal, row_plan, hidden, attn_dtype,
                       prompt_kernel, std::nullopt, nullptr);
    }
    return run_plain(x, cos, sin, ks, vs, kts, slots, end, mask, causal, row_plan, hidden, attn_dtype, prompt_kernel,
                     std::nullopt, nullptr);
  }

  // An EAGLE-3 draft layer (a one-layer loop over the drafter's cache k/v): its attention reads
  // [norm(emb); norm1(x)] (emb: the tokens' embeddings [n, hidden], normed by `emb_norm`, `emb_eps`) and x is its
  // residual stream. Returns the layer's output [n, hidden] before the final norm, which the drafter feeds back.
  Tensor draft(const Tensor& x, const Tensor& emb, const Tensor& emb_norm, double emb_eps, const Tensor& cos,
               const Tensor& sin, const Tensor& k, const Tensor& v, const Tensor& slots, int64_t end,
               const std::optional<Tensor>& mask, bool fused) const {
    TORCH_CHECK(norms1_.size() == 1, "layer loop: a draft layer is a one-layer loop");
    Tensor raw;
    if (fused) {
      TORCH_CHECK(x.scalar_type() == at::kBFloat16, "layer loop: the fused kernels take bf16 rows");
      Tensor prefix = std::get<1>(add_rms_norm(emb, std::nullopt, emb_norm, emb_eps));
      run_fused(x, cos, sin, {k}, {v}, {}, slots, end, mask, false, std::nullopt, false, std::nullopt, false, prefix,
                &raw);
    } else {
      run_plain(x, cos, sin, {k}, {v}, {}, slots, end, mask, false, std::nullopt, false, std::nullopt, false,
                rms_norm(emb, emb_norm, emb_eps), &raw);
    }
    return raw;
  }

 private:
  // `run` without the fused kernels. `prompt_kernel`: a fresh float32 prompt (`causal`) attends through
  // prompt_attention_f32. `prefix`: rows put before the first layer's normed input (`draft`); `raw`: where given,
  // receives the last layer's output before the final norm.
  std::tuple<Tensor, std::vector<Tensor>> run_plain(Tensor x, const Tensor& cos, const Tensor& sin,
                                                    const std::vector<Tensor>& ks, const std::vector<Tensor>& vs,
                                                    const std::vector<Tensor>& kts, const Tensor& slots, int64_t end,
                                                    const std::optional<Tensor>& mask, bool causal,
                                                    const std::optional<RowPlan>& row_plan, bool hidden,
                                                    std::optional<at::ScalarType> attn_dtype, bool prompt_kernel,
                                                    const std::optional<Tensor>& prefix, Tensor* raw) const {
    const int64_t n = x.size(0), qk_width = (heads_ + kv_) * hd_;
    std::vector<Tensor> states;
    if (hidden) states.push_back(x);
    for (size_t i = 0; i < norms1_.size(); ++i) {
      const Layer& l = layers_[i];
      Tensor h = rms_norm(x, norms1_[i], eps1_[i]);
      if (i == 0 && prefix.has_value()) h = at::cat({*prefix, h}, -1);
      Tensor qkv = l.qkv.size() == 1
                       ? linear(l.qkv[0], h)
                       : at::cat({linear(l.qkv[0], h), linear(l.qkv[1], h), linear(l.qkv[2], h)}, -1);
      Tensor qk = qkv.slice(1, 0, qk_width).view({n, heads_ + kv_, hd_});
      const HeadNorms& hn = heads_norms_[i];
      if (hn.q_norm.has_value()) {  // each head normed before the rotary (engine_step.layer_step)
        qk = at::cat({rms_norm(qk.slice(1, 0, heads_), *hn.q_norm, hn.q_eps),
                      rms_norm(qk.slice(1, heads_), *hn.k_norm, hn.k_eps)},
                     1);
      }
      if (hn.rope) {
        qk = qk * cos + qk.view({n, heads_ + kv_, 2, hd_ / 2}).flip(2).view({n, heads_ + kv_, hd_}) * sin;
      }
      Tensor q = qk.slice(1, 0, heads_), k = qk.slice(1, heads_);
      Tensor v = qkv.slice(1, qk_width).view({n, kv_, hd_});
      const Tensor &k_cache = ks[i], &v_cache = vs[i];
      k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.scalar_type()));
      v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.scalar_type()));
      Tensor o;
      if (row_plan.has_value()) {
        o = row_attention(q, k_cache, v_cache, *row_plan, scale_,
                          kts.empty() ? std::optional<Tensor>() : std::optional<Tensor>(kts[i]));
      } else if (causal && prompt_kernel && x.scalar_type() == at::kFloat &&
                 attn_dtype.value_or(k_cache.scalar_type()) == at::kFloat) {  // prompt_attention.h
        o = prompt_attention_f32(q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(),
                                 v.transpose(0, 1).contiguous(), scale_);
      } else {
        const at::ScalarType adt = attn_dtype.value_or(k_cache.scalar_type());
        o = at::scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0).to(adt),
                                             k_cache.slice(1, 0, end).unsqueeze(0).to(adt),
                                             v_cache.slice(1, 0, end).unsqueeze(0).to(adt), mask, 0.0, causal, scale_,
                                             true);
        o = o.select(0, 0).transpose(0, 1).reshape({n, -1}).to(x.scalar_type());
      }
      x = x + linear(l.o, o);
      h = rms_norm(x, norms2_[i], eps2_[i]);
      if (l.mlp.size() == 1) {
        Tensor gate_up = linear(l.mlp[0], h);
        x = x + linear(l.down, at::silu(gate_up.slice(1, 0, inter_)) * gate_up.slice(1, inter_));
      } else {  // transformers' MLP forward: down(act(gate(h)) * up(h))
        x = x + linear(l.down, at::silu(linear(l.mlp[0], h)) * linear(l.mlp[1], h));
      }
      if (hidden) states.push_back(x);
    }
    if (raw != nullptr) *raw = x;
    x = rms_norm(x, final_norm_, final_eps_);
    if (hidden) states.back() = x;
    return {x, states};
  }

  // `run` with the element-wise work in fused_ops.cpp's kernels (each residual add with the norm after it, rotary with
  // the split into heads, SiLU with its product; bf16 or float32 rows), around the same linears and attention. Each kernel computes a row
  // from that row alone, so a row-exact step's rows stay one-token steps. A prompt (no row plan) writes its slots
  // [end - n, end) of the cache in place, and at the cache's start (`causal`) attends to its own keys and values,
  // which are the cache's bits, without reading them back.
  std::tuple<Tensor, std::vector<Tensor>> run_fused(Tensor x, const Tensor& cos, const Tensor& sin,
                                                    const std::vector<Tensor>& ks, const std::vector<Tensor>& vs,
                                                    const std::vector<Tensor>& kts, const Tensor& slots, int64_t end,
                                                    const std::optional<Tensor>& mask, bool causal,
                                                    const std::optional<RowPlan>& row_plan, bool hidden,
                                                    std::optional<at::ScalarType> attn_dtype, bool prompt_kernel,
                                                    const std::optional<Tensor>& prefix, Tensor* raw) const {
    const int64_t n = x.size(0), start = end - n;
    std::vector<Tensor> states;
    if (hidden) states.push_back(x);
    Tensor h = std::get<1>(add_rms_norm(x, std::nullopt, norms1_[0], eps1_[0]));
    if (prefix.has_value()) h = at::cat({*prefix, h}, -1);
    for (size_t i = 0; i < norms1_.size(); ++i) {
      const Layer& l = layers_[i];
      Tensor qkv = l.qkv.size() == 1
                       ? linear(l.qkv[0], h)
                       : at::cat({linear(l.qkv[0], h), linear(l.qkv[1], h), linear(l.qkv[2], h)}, -1);
      const HeadNorms& hn = heads_norms_[i];
      const int64_t qw = heads_ * hd_, kw = kv_ * hd_;
      if (hn.q_norm.has_value()) {  // each head a row of the fused norm, before the rotary
        Tensor qn = std::get<1>(add_rms_norm(qkv.slice(1, 0, qw).reshape({n * heads_, hd_}), std::nullopt,
                                             *hn.q_norm, hn.q_eps));
        Tensor kn = std::get<1>(add_rms_norm(qkv.slice(1, qw, qw + kw).reshape({n * kv_, hd_}), std::nullopt,
                                             *hn.k_norm, hn.k_eps));
        qkv = at::cat({qn.view({n, qw}), kn.view({n, kw}), qkv.slice(1, qw + kw)}, 1);
      }
      Tensor q, k, v;  // [heads or kv, n, head_dim]
      if (hn.rope) {
        std::tie(q, k, v) = rope_split(qkv, cos, sin, heads_, kv_, hd_);
      } else {  // a NoPE layer: the split alone
        q = qkv.slice(1, 0, qw).view({n, heads_, hd_}).transpose(0, 1).contiguous();
        k = qkv.slice(1, qw, qw + kw).view({n, kv_, hd_}).transpose(0, 1).contiguous();
        v = qkv.slice(1, qw + kw).view({n, kv_, hd_}).transpose(0, 1).contiguous();
      }
      const Tensor &k_cache = ks[i], &v_cache = vs[i];
      Tensor o;
      if (row_plan.has_value()) {
        k_cache.index_copy_(1, slots, k.to(k_cache.scalar_type()));
        v_cache.index_copy_(1, slots, v.to(v_cache.scalar_type()));
        o = row_attention(q.transpose(0, 1), k_cache, v_cache, *row_plan, scale_,
                          kts.empty() ? std::optional<Tensor>() : std::optional<Tensor>(kts[i]));
      } else {
        k_cache.narrow(1, start, n).copy_(k);
        v_cache.narrow(1, start, n).copy_(v);
        const at::ScalarType adt = attn_dtype.value_or(k_cache.scalar_type());
        if (causal && adt == at::kBFloat16 && prompt_kernel) {  // prompt_attention.h
          // bf16 brgemm (AMX); without it (AVX512-BF16), the float32 kernel over the bf16 values: ~1.7x faster there
          // than torch's bf16 flash attention at 1,000 tokens
          o = prompt_attention_available()
                  ? prompt_attention(q, k, v, scale_)
                  : prompt_attention_f32(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), scale_);
        } else if (causal && adt == at::kFloat && x.scalar_type() == at::kFloat && prompt_kernel) {
          o = prompt_attention_f32(q, k, v, scale_);
        } else if (causal) {
          o = at::scaled_dot_product_attention(q.unsqueeze(0).to(adt), k.unsqueeze(0).to(adt), v.unsqueeze(0).to(adt),
                                               {}, 0.0, true, scale_, true);
        } else {
          o = at::scaled_dot_product_attention(q.unsqueeze(0).to(adt), k_cache.slice(1, 0, end).unsqueeze(0).to(adt),
                                               v_cache.slice(1, 0, end).unsqueeze(0).to(adt), mask, 0.0, false,
                                               scale_, true);
        }
        if (o.dim() == 4) o = o.select(0, 0).transpose(0, 1).reshape({n, -1});
        o = o.to(x.scalar_type());
      }
      std::tie(x, h) = add_rms_norm(x, linear(l.o, o), norms2_[i], eps2_[i]);
      Tensor act;
      if (l.mlp.size() == 1) {
        Tensor gate_up = linear(l.mlp[0], h);
        act = silu_mul(gate_up.slice(1, 0, inter_), gate_up.slice(1, inter_));
      } else {
        act = silu_mul(linear(l.mlp[0], h), linear(l.mlp[1], h));
      }
      const bool last = i + 1 == norms1_.size();
      std::tie(x, h) = add_rms_norm(x, linear(l.down, act), last ? final_norm_ : norms1_[i + 1],
                                    last ? final_eps_ : eps1_[i + 1]);
      if (hidden) states.push_back(x);
    }
    if (raw != nullptr) *raw = x;
    if (hidden) states.back() = h;
    return {h, states};
  }

  std::vector<Tensor> norms1_, norms2_;
  std::vector<double> eps1_, eps2_;
  std::vector<Layer> layers_;
  std::vector<HeadNorms> heads_norms_;
  Tensor final_norm_;
  double final_eps_;
  int64_t heads_, kv_, hd_, inter_;
  double scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<RowPlan>(m, "RowPlan")
      .def(py::init<bool, int64_t, int64_t, Tensor, Tensor, Tensor, bool, std::optional<Tensor>,
                    std::vector<std::tuple<int64_t, int64_t, bool>>>());
  m.def("row_attention", &row_attention_forward, "row-exact attention (row_attention.h)");
  m.def("row_attention_isa", &row_attention_isa, "row-exact attention through one build (row_attention.h)");
  m.def("row_attention_build", &row_attention_build, "the build row_attention runs on this CPU");
  m.def("add_rms_norm", &add_rms_norm, "a residual add and RMSNorm over bf16 rows (fused_ops.h)");
  m.def("rope_split", &rope_split, "rotary over bf16 qkv rows, split into heads (fused_ops.h)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over bf16 rows (fused_ops.h)");
  m.def("first_max", &first_max, "the first largest logit of each row (row_select.h)");
  m.def("top_logprobs", &top_logprobs, "each row's k most likely tokens and their log probabilities (row_select.h)");
  m.def("prompt_attention", &prompt_attention, "causal attention of a fresh bf16 prompt (prompt_attention.h)");
  m.def("prompt_attention_available", &prompt_attention_available, "whether this CPU runs prompt_attention");
  m.def("prompt_attention_f32", &prompt_attention_f32, "causal attention of a fresh float32 prompt (prompt_attention.h)");
  m.def("prompt_attention_f32_available", &prompt_attention_f32_available,
        "whether this CPU runs prompt_attention_f32 faster than torch's attention");
  py::class_<LayerLoop>(m, "LayerLoop")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<double>, std::vector<double>,
                    std::vector<LayerSpec>, Tensor, double, int64_t, int64_t, int64_t, int64_t, double,
                    std::vector<HeadSpec>>())
      .def("run", &LayerLoop::run)
      .def("draft", &LayerLoop::draft);
}

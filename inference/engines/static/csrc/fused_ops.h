// Fused element-wise kernels for the C++ layer loop's bf16 steps (fused_ops.cpp). Each also takes float32 rows (a
// float32 target's fused loop), with the same arithmetic less the bf16 roundings.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

// Rows of x [n, hidden] bf16, plus delta [n, hidden] bf16 where given (a residual): returns (sum, normed), sum =
// x + delta rounded to bf16 (x itself without delta), normed = weight * bf16(sum * rsqrt(mean(sum^2) + eps)), the
// RMSNorm transformers' Llama family computes, in one pass over each row. weight [hidden] bf16.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                                const at::Tensor& weight, double eps);

// qkv [n, (heads + 2 * kv_heads) * head_dim] bf16 (queries, keys, values): the queries and keys rotated by cos, sin
// [n, head_dim] bf16 (`engine.rope_tables`: sin's first half negated) as x * cos + swap_halves(x) * sin, each product
// and the sum rounded to bf16 as torch's bf16 ops round them. Returns q [heads, n, head_dim], k and v
// [kv_heads, n, head_dim], contiguous: the layout attention and the cache take.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                                                          int64_t head_dim);

// gate, up [n, inter] bf16 (rows may be strided, as slices of one gate_up product): bf16(bf16(silu(gate)) * up)
// [n, inter], the Llama MLP's activation in one pass.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// Row-exact attention (row_attention.cpp): the static engine's bf16/fp16 decoding steps.
#pragma once

#include <ATen/core/Tensor.h>

// q [rows, heads, dim] (any float dtype); k_cache, v_cache [kv_heads, max_len, dim] float32, contiguous; tails
// [m, width] int64 (row i's slots after the cache's first `start`, by depth; the first lens[i] are used), m <= rows:
// rows past m repeat row 0 (the padding of a one-token step). kt_cache: optional [kv_heads, ceil(max_len / 16),
// padded dim, 16] float32, the keys transposed in blocks of 16, current for the first kt_valid slots (complete blocks
// below `start` are written to it). Returns [rows, heads * dim] in q's dtype. Each row's output depends only on its
// query and its sequence of keys and values, never on the other rows, the transposed cache or the threads.
at::Tensor row_attention_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t start, const at::Tensor& tails, const at::Tensor& lens, double scale,
                                 const std::optional<at::Tensor>& kt_cache, int64_t kt_valid);

// row_attention_forward through one build (avx512, avx2, base), without the transposed cache: tests compare them.
at::Tensor row_attention_isa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             int64_t start, const at::Tensor& tails, const at::Tensor& lens, double scale,
                             const std::string& isa);

// The build row_attention_forward runs on this CPU: avx512, avx2 (both with FMA) or base.
std::string row_attention_build();

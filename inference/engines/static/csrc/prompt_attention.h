// Causal attention of a fresh bf16 prompt on the CPU's bf16 matrix units (prompt_attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

// Whether this CPU runs prompt_attention (oneDNN's bf16 brgemm: AMX or AVX512-BF16); elsewhere the layer loop keeps
// torch's scaled_dot_product_attention.
bool prompt_attention_available();

// q [heads, n, head_dim], k and v [kv_heads, n, head_dim] bf16, contiguous (rope_split's outputs): row i attends to
// keys 0..i, heads sharing key-value heads in groups of heads / kv_heads. Returns [n, heads * head_dim] bf16, the
// layout the output projection takes. Scores and their softmax in float32; the probabilities meet the values as bf16,
// as torch's flash attention rounds them. Each (head, block of rows) is one thread's work in a fixed order, so the
// thread count never changes a bit.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);

// Whether prompt_attention_f32 is the faster choice here: AVX-512 CPUs, where float32 brgemm runs 16 lanes (with
// AVX2's it measured slower than torch's flash attention).
bool prompt_attention_f32_available();

// prompt_attention in float32: q [heads, n, head_dim], k and v [kv_heads, n, head_dim] float32, contiguous; returns
// [n, heads * head_dim]. The same blocks of 64 rows, each scoring only the keys it sees; probabilities in float32.
// Each (head, block of rows) is one thread's work in a fixed order, so the thread count never changes a bit.
at::Tensor prompt_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);

// Picks from logit rows for decoding (row_select.cpp): greedy's token and a drafter's most likely tokens.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// logits [n, V] float32 or bf16 (CPU): the first index of each row's largest value [n] int64, the token
// torch's argmax picks (the first NaN where a row has one).
at::Tensor first_max(const at::Tensor& logits);

// logits [n, V] as above and 1 <= k <= V: (log probabilities [n, k] float32, token indices [n, k] int64) of each row's
// k most likely tokens, largest first (ties: the lower index first): log_softmax(logits).topk(k) up to the float
// rounding of the sum of exps.
std::tuple<at::Tensor, at::Tensor> top_logprobs(const at::Tensor& logits, int64_t k);

"""Greedy's token and a drafter's most likely tokens from logit rows
(inference/engines/static/row_select.py and its kernels,
inference/engines/static/csrc/row_select.cpp): argmax's first index among ties, NaN and -inf rows as
torch treats them, the k most likely tokens in order with torch's log probabilities, at any row
count and thread count, and torch's reductions where the kernels do not serve."""

from __future__ import annotations

import pytest
import torch

from headway.inference.engines.static import layer_loop, row_select
from tests.helpers.decode_helpers import with_threads

pytestmark = pytest.mark.skipif(
    layer_loop.extension() is None, reason="the C++ extension does not build here"
)

WIDTHS = [
    49_152,
    8_192,
    100,
    7,
    1,
]  # the default target's and head's vocabularies, a tail, less than one block


def _tied_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of a handful of distinct values, so that each row's largest repeats (bf16 logits tie
    often)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-3, 4, (rows, width), generator=gen) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", WIDTHS)
def test_first_max_is_argmaxs_first_index_at_any_rows_andwith_threads(
    dtype: torch.dtype, width: int
):
    ext = layer_loop.extension()
    for rows in (1, 3, 8):
        x = _tied_rows(rows, width, dtype, seed=rows + width)
        x[0, width // 2] = 9.0  # one row with a single largest value past the first block
        want = torch.tensor([int((r == r.max()).nonzero()[0]) for r in x])
        assert torch.equal(want, x.float().argmax(-1))
        for threads in (1, 2):
            assert torch.equal(with_threads(threads, lambda: ext.first_max(x)), want)
        assert torch.equal(row_select.first_max(x), want)
        assert int(row_select.first_max(x[rows - 1])) == int(
            want[-1]
        )  # a [V] row gives a 0-d index


def test_first_max_takes_the_first_nan_and_the_first_of_minus_infinity_rows():
    ext = layer_loop.extension()
    x = torch.randn(3, 100)
    x[0, [40, 70]] = float("nan")
    x[1] = float("-inf")
    x[2, 99] = float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        assert ext.first_max(rows).tolist() == rows.max(-1).indices.tolist() == [40, 0, 99]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [8_192, 100, 7])
def test_top_logprobs_are_the_k_most_likely_with_torchs_log_probabilities(
    dtype: torch.dtype, width: int
):
    ext = layer_loop.extension()
    gen = torch.Generator().manual_seed(width)
    for rows, k in ((1, 1), (1, 7), (8, min(width, 8)), (3, min(width, 100))):
        x = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
        x[0, : min(width, 20)] = x[0, 0]  # ties: the lower index ranks first
        logp = torch.log_softmax(x.float(), -1)
        # the reference order: largest first, ties by index (a stable sort of the negated values)
        order = torch.sort(-x.float(), dim=-1, stable=True).indices[:, :k]
        for threads in (1, 2):
            values, indices = with_threads(threads, lambda: ext.top_logprobs(x, k))
            assert torch.equal(indices, order)
            torch.testing.assert_close(values, logp.gather(-1, order), atol=2e-5, rtol=1e-5)
        values, indices = row_select.top_logprobs(x, k)
        assert torch.equal(indices, order)


def test_top_logprobs_ignore_minus_infinity_in_the_sum():
    """Masked tokens (-inf) add nothing to the normalising sum, as in log_softmax."""
    ext = layer_loop.extension()
    x = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), 2.0]])
    values, indices = ext.top_logprobs(x, 3)
    assert indices.tolist() == [[4, 2, 0]]
    torch.testing.assert_close(values, torch.log_softmax(x, -1)[:, [4, 2, 0]])


def test_rows_the_kernels_do_not_serve_take_torchs_reductions(monkeypatch):
    """float64 rows, and any rows where the extension is not built, give torch's results."""
    x = torch.randn(4, 300, dtype=torch.float64)
    assert torch.equal(row_select.first_max(x), x.argmax(-1))
    values, indices = row_select.top_logprobs(x, 5)
    top = torch.log_softmax(x.float(), -1).topk(5)
    assert torch.equal(indices, top.indices) and torch.equal(values, top.values)
    monkeypatch.setattr(layer_loop, "built", lambda: None)
    y = x.float()
    assert torch.equal(row_select.first_max(y), y.argmax(-1))
    assert torch.equal(row_select.top_logprobs(y, 5)[1], torch.log_softmax(y, -1).topk(5).indices)

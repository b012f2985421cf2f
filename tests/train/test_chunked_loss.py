"""The chunked vocabulary loss equals the full one, in values and gradients, in float64."""

from __future__ import annotations

import pytest
import torch

from headway.train.chunked_loss import KINDS, chunked_draft_loss
from headway.train.losses import draft_loss, masked_mean
from headway.train.objectives import OBJECTIVES


def inputs(n: int = 37, d: int = 16, vocab: int = 53, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = 3 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    rows = torch.rand(n, generator=g) < 0.7
    return hidden, weight, teacher, rows


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_chunked_equals_full_in_value_and_gradients(kind: str, chunk: int):
    hidden, weight, teacher, rows = inputs()
    if kind == "ce":  # labels: the full loss is cross-entropy on them
        teacher = teacher.argmin(-1)
        per_row = torch.nn.functional.cross_entropy(hidden @ weight.T, teacher, reduction="none")
        full = masked_mean(per_row, rows)
    else:
        full = draft_loss(kind, hidden @ weight.T, torch.softmax(teacher, -1), rows)
    gh, gw = torch.autograd.grad(3.0 * full, (hidden, weight))
    loss, best = chunked_draft_loss(kind, hidden, weight, teacher, rows, chunk)
    ch, cw = torch.autograd.grad(3.0 * loss, (hidden, weight))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ch, gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cw, gw, rtol=1e-10, atol=1e-12)
    assert torch.equal(best, (hidden @ weight.T).argmax(-1))


def test_no_row_kept_gives_zero_loss_and_zero_gradients():
    hidden, weight, teacher, rows = inputs()
    loss, _ = chunked_draft_loss("soft_ce", hidden, weight, teacher, torch.zeros_like(rows), 8)
    loss.backward()
    assert loss == 0 and not hidden.grad.any() and not weight.grad.any()


def test_nothing_vocabulary_sized_is_kept_for_backward():
    hidden, weight, teacher, rows = inputs(n=64, d=8, vocab=1000)
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_draft_loss("soft_ce+tv", hidden, weight, teacher, rows, 16)
    assert kept and all(1000 not in s or s == weight.shape for s in kept)
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        draft_loss("soft_ce+tv", hidden @ weight.T, torch.softmax(teacher, -1), rows)
    assert any(s == (64, 1000) for s in kept)  # the full loss does keep [n, V] tensors


def test_an_unknown_kind_is_named():
    hidden, weight, teacher, rows = inputs()
    with pytest.raises(ValueError, match="unknown draft loss 'kl'"):
        chunked_draft_loss("kl", hidden, weight, teacher, rows, 8)


@pytest.mark.parametrize(
    "kind,attention,extra",
    [
        ("eagle3", "structured", []),
        ("eagle3", "recompute", []),
        ("eagle", "structured", []),
        ("eagle", "recompute", []),
        ("medusa", "structured", []),
        ("medusa", "structured", ["head.medusa.loss=kl"]),
        ("medusa", "structured", ["head.medusa.lm_head=shared"]),
        ("dflash", "structured", ["head.dflash.draft_vocab_size=64"]),
    ],
)
def test_a_head_trains_the_same_with_the_memory_settings(
    tiny_dirs, tiny_data, tmp_path, kind, attention, extra
):
    """One micro-batch of each kind in float64: the chunked loss (and for EAGLE-1 and EAGLE-3 the
    recomputed attention) gives the one-pass, structured loss, metrics and every head gradient."""
    from dataclasses import replace

    from headway.train.step import plan_batch, step_loss
    from tests.helpers.train_helpers import (
        assert_same_training,
        loss_and_grads,
        recipe_parts,
        small_run,
    )

    cfg = small_run(
        tiny_dirs["llama"],
        tiny_data,
        tmp_path / "r",
        f"head.kind={kind}",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=3",
        "head.eagle.feature_noise=0",
        *extra,
    )
    run, target, data, model = recipe_parts(cfg, float64=True)
    batch = data.train_set[:4]
    results = []
    for chunk, how in ((0, "structured"), (5, attention)):
        objective = OBJECTIVES[kind](model.heads.cfg, seed=0, loss_chunk=chunk, ttt_attention=how)
        from headway.train.distributed import HeadObjective

        context = replace(
            model.context, objective=HeadObjective(model.heads, objective), plan=objective
        )
        planned = plan_batch(batch, 0, objective)
        results.append(loss_and_grads(model.heads, lambda: step_loss(context, planned, batch)))
    assert_same_training(*results)

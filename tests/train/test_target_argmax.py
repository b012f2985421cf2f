"""train.target_argmax=data: on greedy self-distilled data the token after t is the target's argmax
at t, so the kinds that need only that argmax (EAGLE-3, DFlash; Medusa with CE) train the same
without the target's full lm_head."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from headway.errors import HeadwayError
from headway.train import loop
from headway.train.step import plan_batch, step_loss
from tests.helpers.train_helpers import recipe_parts, small_run

CASES = {
    "eagle3": ["head.kind=eagle3", "head.eagle3.draft_vocab_size=64", "head.eagle3.ttt_steps=3"],
    "dflash": ["head.kind=dflash", "head.dflash.draft_vocab_size=64"],
    "medusa": ["head.kind=medusa"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_datas_next_token_trains_as_the_targets_argmax(
    tiny_dirs, tiny_data, tmp_path: Path, case: str
):
    cfg = small_run(tiny_dirs["llama"], tiny_data, tmp_path / "r", *CASES[case])
    run, target, data, model = recipe_parts(cfg)
    assert data.greedy  # the fixture's data was distilled at temperature 0
    assert not model.context.plan.needs_logits
    samples = data.train_set[:4]
    planned = plan_batch(samples, 0, model.context.plan)
    # the fixture's target wrote these answers greedily: its argmax at each answer's previous token
    # is it
    with torch.no_grad():
        argmax = target.model(input_ids=planned["input_ids"]).logits.argmax(-1)
    answer = planned["loss_mask"][:, 1:].bool()
    assert torch.equal(argmax[:, :-1][answer], planned["input_ids"][:, 1:][answer])
    results = []
    for from_data in (False, True):
        context = replace(model.context, argmax_from_data=from_data)
        model.heads.zero_grad()
        loss, metrics = step_loss(context, planned, samples)
        loss.backward()
        results.append(
            (loss.detach(), metrics, {n: p.grad.clone() for n, p in model.heads.named_parameters()})
        )
    (a, am, ag), (b, bm, bg) = results
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for k in am:
        torch.testing.assert_close(bm[k], am[k], rtol=1e-6, atol=1e-7, msg=k)
    for k in ag:
        torch.testing.assert_close(bg[k], ag[k], rtol=1e-5, atol=1e-7, msg=k)


def test_the_datas_next_token_is_refused_on_sampled_data():
    with pytest.raises(
        HeadwayError, match="train.target_argmax=data needs datasets distilled at temperature 0"
    ):
        loop.argmax_from_data("data", torch.device("cpu"), greedy=False)
    assert loop.argmax_from_data("auto", torch.device("cuda"), greedy=True)
    assert not loop.argmax_from_data("auto", torch.device("cpu"), greedy=True)
    assert not loop.argmax_from_data("auto", torch.device("cuda"), greedy=False)

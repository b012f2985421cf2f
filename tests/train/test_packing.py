"""Packing (train/packing.py): a packed micro-batch trains as the padded one of the same sequences.

In float64, for every head kind: the same loss, metrics and head gradients from the sequences packed
two to a row (document-causal attention, positions restarting at each sequence) as from the same
sequences padded one to a row. Then the batches themselves: fixed shapes, the stream's order, and a
resumed packed run on the uninterrupted run's curve.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from headway.config import load_config
from headway.errors import HeadwayError
from headway.run_config import RunConfig
from headway.train import loop
from headway.train.distributed import HeadObjective
from headway.train.objectives import OBJECTIVES
from headway.train.packing import collate_packed, pack_at
from headway.train.step import plan_batch, plan_packed, step_loss
from headway.train.target_features import target_features
from tests.helpers.tiny_models import ARCHS, make_tiny_model
from tests.helpers.train_helpers import (
    assert_same_training,
    loss_and_grads,
    losses,
    recipe_parts,
    small_run,
)

CASES = {
    "medusa": ["head.kind=medusa"],
    "medusa-kl": ["head.kind=medusa", "head.medusa.loss=kl"],
    "eagle": ["head.kind=eagle", "head.eagle.feature_noise=0"],
    "eagle3": ["head.kind=eagle3", "head.eagle3.draft_vocab_size=64", "head.eagle3.ttt_steps=3"],
    "eagle3-recompute": [
        "head.kind=eagle3",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=3",
    ],
    # every answer position an anchor, so both layouts draw the same ones
    "dflash": ["head.kind=dflash", "head.dflash.draft_vocab_size=64", "head.dflash.anchors=512"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_rows_train_as_the_padded_ones(tiny_dirs, tiny_data, tmp_path: Path, case: str):
    cfg = small_run(tiny_dirs["llama"], tiny_data, tmp_path / "r", *CASES[case])
    run, target, data, model = recipe_parts(cfg, float64=True)
    kind = cfg.head.kind
    attention = "recompute" if case.endswith("recompute") else "structured"
    objective = OBJECTIVES[kind](model.heads.cfg, seed=0, ttt_attention=attention)
    context = replace(
        model.context, objective=HeadObjective(model.heads, objective), plan=objective
    )
    samples = data.train_set[:4]
    rows = [samples[:2], samples[2:]]
    length = max(sum(len(s.input_ids) for s in row) for row in rows) + 3  # some padding too
    results = [
        loss_and_grads(model.heads, lambda: step_loss(context, planned, samples))
        for planned in (plan_batch(samples, 0, objective), plan_packed(rows, length, 0, objective))
    ]
    assert_same_training(*results)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_target_sees_each_packed_sequence_alone(tmp_path: Path, arch: str):
    """The packed forward's hidden states and logits at each sequence's tokens are that sequence's
    own forward's (float64; Gemma-3's rows wider than its sliding window take transformers' own
    packed path)."""
    from transformers import AutoModelForCausalLM

    from headway.train.data import Sample

    model = (
        AutoModelForCausalLM.from_pretrained(make_tiny_model(arch, tmp_path / arch)).double().eval()
    )
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (70, 50, 40)]
    rows = [[Sample(seqs[0], [1] * 70), Sample(seqs[1], [1] * 50)], [Sample(seqs[2], [1] * 40)]]
    batch = collate_packed(rows, 140 if arch == "gemma3" else 125, 0)
    layers = [0, 1, model.config.num_hidden_layers]
    with torch.no_grad():
        hidden, logits = target_features(
            model, batch["input_ids"], layers, batch["positions"], batch["doc"]
        )
        at = [(0, 0), (0, 70), (1, 0)]
        for seq, (r, start) in zip(seqs, at):
            out = model(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False)
            n = len(seq)
            torch.testing.assert_close(
                logits[r, start : start + n], out.logits[0], rtol=1e-9, atol=1e-9
            )
            for i in layers:
                torch.testing.assert_close(hidden[i][r, start : start + n], out.hidden_states[i][0])


def test_packed_batches_have_one_shape_and_follow_the_stream(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.train.data import batch_at

    cfg = small_run(tiny_dirs["llama"], tiny_data, tmp_path / "r")
    target = loop.setup_target(loop.setup_run(cfg))
    train_set = loop.setup_data(loop.setup_run(cfg), target).train_set
    rows, end = pack_at(train_set, 5, 3, 160, seed=7)
    taken = [s for row in rows for s in row]
    assert taken == batch_at(train_set, 5, end - 5, 7)  # the padded stream's order, nothing skipped
    assert all(sum(len(s.input_ids) for s in row) <= 160 for row in rows)
    nxt = batch_at(train_set, end, 1, 7)[0]
    # full: the next did not fit
    assert sum(len(s.input_ids) for s in rows[-1]) + len(nxt.input_ids) > 160
    batch = collate_packed(rows, 160, 0)
    assert all(v.shape == (3, 160) for v in batch.values())
    assert (batch["doc"] >= 0).eq(batch["attention_mask"].bool()).all()
    assert pack_at(train_set, 5, 3, 160, seed=7) == (rows, end)  # a pure function of its arguments


def test_a_packed_run_killed_at_a_checkpoint_resumes_on_the_uninterrupted_curve(
    tiny_dirs, tiny_data, tmp_path: Path
):
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers.train_helpers import small_run_args

    packing = ["head.kind=eagle3", "head.eagle3.draft_vocab_size=64", "train.packing=true"]
    packing += ["train.max_length=128", "train.pack_length=160", "train.eval_every=0"]

    def headway_train(out: Path, kill_at: str = "") -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("HEADWAY_KILL_AT", None)
        if kill_at:
            env["HEADWAY_KILL_AT"] = kill_at
        args = small_run_args(tiny_dirs["llama"], tiny_data, out, *packing)
        cmd = [sys.executable, "-m", "headway", "train", *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    loop.train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "whole", *packing))
    assert headway_train(tmp_path / "cut", kill_at="checkpoint:3").returncode == -signal.SIGKILL
    res = headway_train(tmp_path / "cut")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "effective batch: 4 packed rows of 160 tokens" in res.stderr
    whole, cut = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert [s for s, _ in whole] == [s for s, _ in cut] == [1, 2, 3, 4, 5, 6]
    assert [x for _, x in cut] == pytest.approx([x for _, x in whole], rel=1e-6)


def test_packing_settings_are_checked_before_the_model_loads():
    with pytest.raises(
        HeadwayError, match=r"train.pack_length=100 must be 0 \(train.max_length\) or at least"
    ):
        load_config(
            RunConfig, None, ["train.packing=true", "train.max_length=128", "train.pack_length=100"]
        )
    with pytest.raises(
        HeadwayError, match="train.packing runs the target on the packed rows: it needs online"
    ):
        load_config(RunConfig, None, ["train.packing=true", "train.features_dir=[x]"])

"""Training-time test computes only the positions a loss reads: same loss, same gradients as the
dense unroll."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from headway.heads.draft_layer import drafter_mask
from headway.train.losses import target_to_draft, wide
from headway.train.objectives import Features
from headway.train.objectives.eagle3 import Eagle3Objective
from headway.train.ttt import causal_allowed, kept_positions, shifted, ttt_unroll
from tests.helpers.decode_helpers import load64
from tests.helpers.train_helpers import loss_and_grads
from tests.kinds.test_eagle import ARCHS, random_head


def dense_eagle3_loss(heads, batch: dict, feats: Features, t2d: torch.Tensor) -> torch.Tensor:
    """The unroll as it was first written: every position at every step, one dense [T, (j+1) T] mask
    per step."""
    ec = heads.cfg
    ids, attn = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    base = causal_allowed(attn)
    eye = torch.eye(T, dtype=torch.bool).expand(B, T, T)
    cache = DynamicCache(config=heads.decoder.config)
    hidden = heads.project(feats.cat(ec.feature_layers))
    target_p = torch.softmax(wide(feats.draft_logits(heads.d2t)), -1)
    in_draft = t2d[feats.argmax] >= 0
    total = target_p.new_zeros(())
    for j in range(ec.ttt_steps):
        allowed = torch.cat([base] + [eye] * j, dim=-1)
        pos = (torch.arange(T) + j).unsqueeze(0)
        out = heads(
            shifted(ids, 1 + j), hidden, pos, drafter_mask(allowed, heads.fc.weight.dtype), cache
        )
        hidden = heads.next_hidden(out)
        valid = shifted(batch["loss_mask"], 2 + j).bool() & shifted(in_draft, 1 + j, False)
        if valid.any():
            logits = wide(heads.logits(out[valid]))
            p = shifted(target_p, 1 + j)[valid]
            total = total + ec.ttt_decay**j * -(p * F.log_softmax(logits, -1)).sum(-1).mean()
    return total


def padded_batch(t, seed: int = 3) -> tuple[dict, Features]:
    """Three rows of different lengths (right-padded), each a prompt then an answer, with random
    features."""
    torch.manual_seed(seed)
    B, T, V = 3, 16, t.config.vocab_size
    lengths, prompts = [16, 11, 7], [5, 6, 2]
    ids = torch.randint(0, V, (B, T))
    attn = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        attn[b, :n] = 1
        loss_mask[b, p:n] = 1
    L = t.config.num_hidden_layers
    hidden = {i: torch.randn(B, T, t.config.hidden_size, dtype=torch.float64) for i in range(L + 1)}
    logits = torch.randn(B, T, V, dtype=torch.float64) * 3
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    return batch, Features(hidden, logits)


@pytest.mark.parametrize("norm_output", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_unroll_gives_the_dense_loss_and_gradients(tiny_dirs, arch: str, norm_output: bool):
    t = load64(tiny_dirs[arch])
    heads = random_head(t, "eagle3").train()
    heads.cfg.ttt_steps = 4
    # EAGLE-3.1: each step reads the previous one's normed output
    heads.cfg.norm_output = norm_output
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))

    def grads(loss_fn):
        loss, _, got = loss_and_grads(heads, loss_fn)
        return loss, got

    dense_loss, dense_grads = grads(lambda: dense_eagle3_loss(heads, batch, feats, t2d))
    sparse_loss, sparse_grads = grads(
        lambda: Eagle3Objective(heads.cfg)(heads, batch, feats, t2d)[0]
    )
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-10, atol=1e-12)
    assert dense_grads.keys() == sparse_grads.keys() and len(dense_grads) > 5
    for name, g in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)


def test_unroll_skips_positions_no_loss_reads(tiny_dirs):
    """With the prompt masked out, steps j >= 1 run on the answer's positions only (and pad the
    shorter row)."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    batch, feats = padded_batch(t)
    needed = torch.zeros(3, 16, dtype=torch.bool)
    needed[0, 4:9] = True
    needed[2, 1:3] = True
    index, kept = kept_positions(needed)
    assert index.tolist() == [[4, 5, 6, 7, 8], [0, 0, 0, 0, 0], [1, 2, 0, 0, 0]]
    assert kept.sum(1).tolist() == [5, 0, 2]
    with torch.no_grad():
        hidden = heads.project(feats.cat(heads.cfg.feature_layers))
        sparse = ttt_unroll(heads, batch["input_ids"], batch["attention_mask"], hidden, 3, needed)
        full = ttt_unroll(heads, batch["input_ids"], batch["attention_mask"], hidden, 3)
    assert sparse.outputs[0].shape[1] == 16 and sparse.outputs[2].shape[1] == 5
    for j in (1, 2):
        torch.testing.assert_close(sparse.outputs[j][0], full.outputs[j][0, 4:9])
        torch.testing.assert_close(sparse.outputs[j][2, :2], full.outputs[j][2, 1:3])


def test_draft_losses_match_hand_computed_values():
    from headway.train.losses import draft_loss

    logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    p = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64)
    q1 = torch.tensor([2.0, 0.0]).softmax(0).double()  # [0.8808, 0.1192]
    soft = (
        -(0.75 * torch.log(torch.tensor(0.5)) + 0.25 * torch.log(torch.tensor(0.5)))
        - (0.5 * q1[0].log() + 0.5 * q1[1].log())
    ) / 2
    tv = (0.5 * (0.25 + 0.25) + 0.5 * (abs(q1[0] - 0.5) + abs(q1[1] - 0.5))) / 2
    # both rows' target argmax is token 0
    argmax = (-torch.log(torch.tensor(0.5)) - q1[0].log()) / 2
    assert float(draft_loss("soft_ce", logits, p)) == pytest.approx(float(soft))
    assert float(draft_loss("tv", logits, p)) == pytest.approx(float(tv))
    assert float(draft_loss("soft_ce+tv", logits, p)) == pytest.approx(float(soft + tv))
    assert float(draft_loss("argmax_ce", logits, p)) == pytest.approx(float(argmax))


def test_simulated_chain_acceptance_counts_leading_hits():
    from headway.train.losses import chain_acceptance

    valid0 = torch.tensor([[True, True, True, False]])
    correct = [
        torch.tensor([[True, True, False, True]]),
        torch.tensor([[True, False, True, True]]),
        torch.tensor([[True, True, True, True]]),
    ]
    # runs at the three valid positions: 3, 1, 0 -> tau = 1 + 4/3
    assert float(chain_acceptance(correct, valid0)) == pytest.approx(1 + 4 / 3)


def test_eagle3_logs_simulated_tau_and_takes_each_loss(tiny_dirs):
    t = load64(tiny_dirs["qwen2"])
    heads = random_head(t, "eagle3")
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
    seen = {}
    for loss in ("soft_ce", "argmax_ce", "tv", "soft_ce+tv"):
        heads.cfg.loss = loss
        value, metrics = Eagle3Objective(heads.cfg)(heads, batch, feats, t2d)
        seen[loss] = float(value.detach())
        assert 1.0 <= metrics["tau/chain"] <= 1 + heads.cfg.ttt_steps
    assert seen["soft_ce+tv"] == pytest.approx(seen["soft_ce"] + seen["tv"])
    assert len(set(seen.values())) == 4


def test_draft_layer_can_start_as_a_target_layer(tiny_dirs):
    from headway.heads.eagle3 import Eagle3Config

    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    heads.cfg.init_layer = 1
    heads.init_from_target(t.model)
    own, src = heads.decoder.layers[0], t.model.model.layers[1]
    h = t.config.hidden_size
    torch.testing.assert_close(own.mlp.down_proj.weight, src.mlp.down_proj.weight)
    torch.testing.assert_close(own.self_attn.q_proj.weight[:, h:], src.self_attn.q_proj.weight)
    assert not own.self_attn.q_proj.weight[:, :h].any()
    torch.testing.assert_close(own.input_layernorm.hidden_norm.weight, src.input_layernorm.weight)
    heads.cfg.init_layer = 9
    with pytest.raises(
        Exception, match=r"init_layer=9 is not a layer of this 4-layer target: use 0..3"
    ):
        heads.init_from_target(t.model)
    with pytest.raises(Exception, match="head.eagle3.loss='kl' is not allowed"):
        Eagle3Config(loss="kl")


def test_a_new_run_starts_from_a_heads_weights(tiny_dirs, tiny_data, tmp_path):
    """train.init_from: the first run's head is where the second starts (weights and draft
    vocabulary); a head of another kind or another shape is refused before training, naming the
    fix."""
    from headway.errors import HeadwayError
    from headway.kinds.checkpoint import load_head
    from headway.target.config import TargetConfig
    from headway.target.loading import load_target
    from headway.train.loop import train
    from headway.train.setup_heads import build_heads
    from tests.helpers.train_helpers import small_run

    base = (
        "head.kind=eagle3",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=2",
        "train.eval_every=0",
        "train.save_every=0",
        "train.max_steps=3",
    )
    first = train(small_run(tiny_dirs["llama"], tiny_data, tmp_path / "first", *base))
    cfg = small_run(
        tiny_dirs["llama"],
        tiny_data,
        tmp_path / "second",
        *base,
        f"train.init_from={first}",
        "head.eagle3.ttt_steps=3",
        "head.eagle3.loss=tv",
    )
    t = load_target(TargetConfig(name_or_path=str(tiny_dirs["llama"]), device="cpu"))
    started = build_heads(cfg.head, cfg.train.init_from, t, [])
    saved = load_head(first)
    assert started.cfg.ttt_steps == 3 and started.cfg.loss == "tv"
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(
            started.state_dict()[name], value.to(started.state_dict()[name].dtype)
        )
    assert train(cfg).is_dir()
    wrong = small_run(
        tiny_dirs["llama"],
        tiny_data,
        tmp_path / "third",
        *base,
        f"train.init_from={first}",
        "head.eagle3.draft_vocab_size=32",
    )
    with pytest.raises(
        HeadwayError,
        match=r"was trained with head.eagle3: draft_vocab_size=64, which this run sets",
    ):
        build_heads(wrong.head, wrong.train.init_from, t, [])
    medusa = small_run(
        tiny_dirs["llama"], tiny_data, tmp_path / "fourth", f"train.init_from={first}"
    )
    with pytest.raises(
        HeadwayError, match=r"holds a 'eagle3' head, but this run trains head.kind=medusa"
    ):
        build_heads(medusa.head, medusa.train.init_from, t, [])
    with pytest.raises(HeadwayError, match="is not a head directory"):
        train(
            small_run(
                tiny_dirs["llama"], tiny_data, tmp_path / "fifth", f"train.init_from={tmp_path}"
            )
        )


def test_duplicate_answers_are_dropped_by_the_configured_rule():
    from headway.train.dedup import duplicates

    base = tuple(range(100, 160))
    near = base[:58] + (7, 8)  # the same answer but its last two tokens
    other = tuple(range(300, 360))
    answers = [base, near, base, other, tuple(reversed(base))]
    assert duplicates(answers, "none") == [False] * 5
    assert duplicates(answers, "exact") == [False, False, True, False, False]
    assert duplicates(answers, "near", 0.8) == [False, True, True, False, False]
    assert duplicates(answers, "near", 1.0) == [False, False, True, False, False]
    with pytest.raises(
        Exception, match=r"train.dedup='fuzzy' is not allowed: use one of none, exact, near"
    ):
        from headway.train.config import TrainConfig

        TrainConfig(dedup="fuzzy")


def test_evaluation_can_read_datasets_never_trained_on(tiny_dirs, tiny_data, tmp_path):
    import json
    import shutil

    from headway.errors import HeadwayError
    from headway.train.loop import train
    from tests.helpers.train_helpers import small_run

    evalset = tmp_path / "eval"
    shutil.copytree(tiny_data, evalset)
    base = (
        "head.kind=eagle3",
        "head.eagle3.draft_vocab_size=64",
        "head.eagle3.ttt_steps=2",
        "train.save_every=0",
    )
    train(
        small_run(
            tiny_dirs["llama"],
            tiny_data,
            tmp_path / "run",
            *base,
            f"train.eval_datasets=[{evalset}]",
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tau/chain" in r]
    assert evals and all(1.0 <= r["eval/tau/chain"] <= 3.0 for r in evals)
    with pytest.raises(HeadwayError, match=r"are also train.datasets"):
        train(
            small_run(
                tiny_dirs["llama"],
                tiny_data,
                tmp_path / "bad",
                *base,
                f"train.eval_datasets=[{tiny_data}]",
            )
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_flex_attention_gives_the_dense_unrolls_loss(tiny_dirs, arch: str):
    """The CUDA path's block masks (train/ttt_flex.py) are the dense unroll's masks: the same loss
    in float64. Torch runs flex attention's backward on CUDA only, so here it runs forward; its
    gradients are torch's own through the same masks."""
    t = load64(tiny_dirs[arch])
    heads = random_head(t, "eagle3").eval()
    heads.cfg.ttt_steps = 4
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
    objective = Eagle3Objective(heads.cfg, ttt_attention="flex")
    with torch.no_grad():
        dense = dense_eagle3_loss(heads, batch, feats, t2d)
        flex, metrics = objective(heads, {**batch, **objective.plan(batch)}, feats, t2d)
    torch.testing.assert_close(flex, dense, rtol=1e-10, atol=1e-12)
    assert flex.dtype == torch.float64 and "tau/chain" in metrics


def test_flex_attention_off_cuda_is_refused_before_the_target_loads(tmp_path):
    from headway.config import load_config
    from headway.errors import HeadwayError
    from headway.run_config import RunConfig
    from headway.train.loop import setup_run

    cfg = load_config(
        RunConfig,
        None,
        [
            "target.device=cpu",
            "train.ttt_attention=flex",
            "train.datasets=[x]",
            f"train.output_dir={tmp_path}",
        ],
    )
    with pytest.raises(
        HeadwayError, match=r"train.ttt_attention=flex needs a CUDA device .* on cpu: use "
    ):
        setup_run(cfg)


@pytest.mark.parametrize("norm_output", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_recomputed_attention_gives_the_dense_loss_and_gradients(
    tiny_dirs, arch: str, norm_output: bool, monkeypatch
):
    """train.ttt_attention=recompute (scores recomputed in backward, in chunks of 5 queries here)
    gives the dense unroll's loss and gradients."""
    from headway.train import ttt_recompute

    monkeypatch.setattr(ttt_recompute, "CHUNK", 5)
    t = load64(tiny_dirs[arch])
    heads = random_head(t, "eagle3").train()
    heads.cfg.ttt_steps = 4
    heads.cfg.norm_output = norm_output
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
    objective = Eagle3Objective(heads.cfg, ttt_attention="recompute")

    def grads(loss_fn):
        loss, _, got = loss_and_grads(heads, loss_fn)
        return loss, got

    dense_loss, dense_grads = grads(lambda: dense_eagle3_loss(heads, batch, feats, t2d))
    loss, got = grads(lambda: objective(heads, {**batch, **objective.plan(batch)}, feats, t2d)[0])
    torch.testing.assert_close(loss, dense_loss, rtol=1e-10, atol=1e-12)
    assert dense_grads.keys() == got.keys() and len(dense_grads) > 5
    for name, g in dense_grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-9, atol=1e-12, msg=name)

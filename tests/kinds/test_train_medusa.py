"""Medusa training: label alignment, the loss against hand-computed values, resume equivalence,
round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from headway.config import load_config, save_config
from headway.errors import HeadwayError
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.tree import build_tree
from headway.inference.generate import greedy_generate, speculative_generate
from headway.kinds.checkpoint import load_head
from headway.run_config import RunConfig
from headway.target.config import TargetConfig
from headway.target.loading import load_target
from headway.target.packed_model import linear_weights
from headway.train.losses import IGNORE, medusa_labels, medusa_loss, target_to_draft
from tests.helpers.decode_helpers import fast_format, float64_run
from tests.helpers.train_helpers import losses, small_run


def test_labels_look_two_plus_i_ahead_and_follow_the_mask():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1]])
    labels = medusa_labels(ids, mask, 2, None)
    assert labels[0, 0].tolist() == [12, 13, IGNORE, 15, IGNORE, IGNORE]  # head 0: token t+2
    assert labels[1, 0].tolist() == [13, IGNORE, 15, IGNORE, IGNORE, IGNORE]  # head 1: token t+3
    d2t = torch.tensor([12, 15])  # reduced vocabulary: 13 has no draft id
    labels = medusa_labels(ids, mask, 1, target_to_draft(d2t, 20, ids.device))
    assert labels[0, 0].tolist() == [0, IGNORE, IGNORE, 1, IGNORE, IGNORE]


def test_loss_matches_hand_computation():
    logits = torch.tensor(
        [[[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]], [[[0.0, 0.0, 3.0], [1.0, 1.0, 1.0]]]]
    )  # [K=2,B=1,T=2,V=3]
    labels = torch.tensor([[[0, 1]], [[2, IGNORE]]])
    loss, metrics = medusa_loss(logits, labels, decay=0.8)

    def ce(row, y):
        return -math.log(math.exp(row[y]) / sum(math.exp(v) for v in row))

    head0 = (ce([2, 0, 0], 0) + ce([0, 1, 0], 1)) / 2
    head1 = ce([0, 0, 3], 2)
    assert loss.item() == pytest.approx(head0 + 0.8 * head1, rel=1e-6)
    assert metrics["top1/head0"] == 1.0 and metrics["top1/head1"] == 1.0
    soft = torch.zeros(2, 1, 2, 3)
    soft[..., 0] = 1.0  # all mass on token 0: soft CE == CE to token 0
    loss_kl, _ = medusa_loss(logits, labels, decay=0.8, soft_targets=soft)
    expected = (ce([2, 0, 0], 0) + ce([0, 1, 0], 0)) / 2 + 0.8 * ce([0, 0, 3], 0)
    assert loss_kl.item() == pytest.approx(expected, rel=1e-6)


MEDUSA_HEAD = (
    "head.kind=medusa",
    "head.medusa.num_heads=3",
    "head.medusa.lm_head=reduced",
    "head.medusa.draft_vocab_size=64",
)


def train_cfg(model_dir: Path, data: Path, out: Path, *extra: str) -> RunConfig:
    return small_run(model_dir, data, out, *MEDUSA_HEAD, *extra)


MEDUSA2 = (
    "head.medusa.lora.enabled=true",
    "head.medusa.lora.heads_warmup_steps=2",
    "head.medusa.lora.lr=0.01",
    "head.medusa.lora.r=4",
)


@pytest.mark.parametrize("variant", ["medusa1", "medusa2"])
def test_resumed_run_continues_the_same_curve(
    tiny_dirs, tiny_data, tmp_path: Path, monkeypatch, variant: str
):
    from headway.train import loop, resume

    extra = MEDUSA2 if variant == "medusa2" else ()
    full = loop.train(train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "full", *extra))
    ref = losses(tmp_path / "full")
    assert [s for s, _ in ref] == [1, 2, 3, 4, 5, 6] and ref[-1][1] < ref[0][1]  # it learns

    real_save = resume.save_checkpoint

    def crash_after_first_checkpoint(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt("killed after step 3")

    monkeypatch.setattr(resume, "save_checkpoint", crash_after_first_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        loop.train(train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "cut", *extra))
    monkeypatch.setattr(resume, "save_checkpoint", real_save)
    loop.train(
        train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "cut", "train.resume_from=auto", *extra)
    )
    # steps 1-3 before the crash, 4-6 after the resume: identical
    assert losses(tmp_path / "cut") == ref
    a = load_head(full, None)
    b = load_head(tmp_path / "cut" / "head", None)
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v, rtol=0, atol=0)
    if variant == "medusa2":
        from safetensors.torch import load_file

        lora_a = load_file(str(full / "lora" / "adapter_model.safetensors"))
        lora_b = load_file(str(tmp_path / "cut" / "head" / "lora" / "adapter_model.safetensors"))
        assert lora_a.keys() == lora_b.keys() and all(
            torch.equal(lora_a[k], lora_b[k]) for k in lora_a
        )
        # the adapters did train
        assert any("lora_B" in k and lora_a[k].abs().sum() > 0 for k in lora_a)


def test_medusa2_decodes_the_adapted_target_exactly(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.inference.api import SpeculativeDecoder
    from headway.train.loop import train

    head_dir = train(
        train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "m2", *MEDUSA2, "train.max_steps=4")
    )
    rows = [json.loads(line) for line in (tmp_path / "m2" / "log.jsonl").read_text().splitlines()]
    # heads alone first, then adapters
    assert "loss/distill" not in rows[0] and "loss/distill" in rows[-2]
    assert json.loads((head_dir / "config.json").read_text())["adapted_target"] == "lora"
    cfg = float64_run(
        tiny_dirs["llama"], "inference.max_new_tokens=16", "inference.tree=[[0],[1],[0,0],[0,0,0]]"
    )
    decoder = SpeculativeDecoder.load(head_dir, cfg)
    assert not hasattr(decoder.target.model, "peft_config")  # merged: a plain model again
    result = decoder.chat("Question 2: what is 2 plus 3?")
    assert result.spec.tokens == result.plain.tokens  # exact, against the adapted target
    # left at float32: the adapted target merged, then packed in the CPU's fast format
    cfg = load_config(
        RunConfig,
        None,
        [f"target.name_or_path={tiny_dirs['llama']}", "target.device=cpu", "target.num_threads=1"]
        + ["inference.max_new_tokens=16", "inference.tree=[[0],[1],[0,0],[0,0,0]]"],
    )
    decoder = SpeculativeDecoder.load(head_dir, cfg)
    assert linear_weights(decoder.target.model) == fast_format()[1]
    result = decoder.chat("Question 2: what is 2 plus 3?")
    assert result.spec.tokens == result.plain.tokens


def test_trained_head_round_trips_and_decodes_exactly(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.train.loop import train

    head_dir = train(
        train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "run", "train.max_steps=4")
    )
    config = json.loads((head_dir / "config.json").read_text())
    assert (
        config["kind"] == "medusa"
        and config["draft_vocab_size"] == 64
        and config["head"]["num_heads"] == 3
    )
    target = load_target(
        TargetConfig(
            name_or_path=str(tiny_dirs["llama"]), device="cpu", num_threads=1, dtype="float64"
        )
    )
    heads = load_head(head_dir, target.fingerprint, dtype=torch.float64)
    drafter = MedusaDrafter(
        heads, build_tree([[0], [1], [0, 0], [0, 0, 0]]), target.config.num_hidden_layers
    )
    ids = target.tokenizer(
        "<|im_start|>user\nQuestion 3: what is 3 plus 4?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    stop = [target.tokenizer.eos_token_id]
    assert (
        speculative_generate(target.model, drafter, ids, 30, stop).tokens
        == greedy_generate(target.model, ids, 30, stop).tokens
    )
    other = load_target(
        TargetConfig(name_or_path=str(tiny_dirs["qwen2"]), device="cpu"), with_model=False
    )
    with pytest.raises(
        HeadwayError,
        match=rf"was made for target {target.fingerprint['id']} but the loaded target is "
        rf"{other.fingerprint['id']} \(architecture: LlamaForCausalLM vs Qwen2ForCausalLM",
    ):
        load_head(head_dir, other.fingerprint)


def test_medusa_settings_under_their_old_train_keys_load_into_head_medusa(tmp_path: Path, caplog):
    """train.loss, train.decay and train.lora (before issue 54) are read as head.medusa.*, from a
    file or the command line, with a warning naming the new key; the config saved from it uses the
    new keys."""
    old = tmp_path / "old.yaml"
    old.write_text(
        "head:\n  kind: medusa\n"
        "train:\n  loss: kl\n  decay: 0.5\n  lora:\n    enabled: true\n    r: 4\n  max_steps: 7\n"
    )
    with caplog.at_level("WARNING", logger="headway"):
        cfg = load_config(RunConfig, old, ["train.lora.lr=0.01", "train.lora.heads_warmup_steps=3"])
    medusa = cfg.head.medusa
    assert (medusa.loss, medusa.decay, medusa.lora.enabled, medusa.lora.r) == ("kl", 0.5, True, 4)
    assert (medusa.lora.lr, medusa.lora.heads_warmup_steps, cfg.train.max_steps) == (0.01, 3, 7)
    assert cfg.target_lora() is medusa.lora
    for key in ("loss", "decay", "lora"):
        assert f"{old}: train.{key} was renamed head.medusa.{key}" in caplog.text
    assert "the command line: train.lora was renamed head.medusa.lora" in caplog.text
    saved = OmegaConf.load(save_config(cfg, tmp_path / "run"))
    assert "loss" not in saved.train and "lora" not in saved.train and saved.head.medusa.lora.r == 4
    assert load_config(RunConfig, tmp_path / "run" / "config.yaml") == cfg
    with pytest.raises(
        HeadwayError, match="sets both train.loss and head.medusa.loss: keep head.medusa.loss"
    ):
        load_config(RunConfig, None, ["train.loss=kl", "head.medusa.loss=ce"])
    with pytest.raises(HeadwayError, match="head.medusa.loss='mse' is not allowed"):
        load_config(RunConfig, None, ["train.loss=mse"])
    with pytest.raises(
        HeadwayError, match=r"\(head.medusa.lora.enabled\): its LoRA target must run in every step"
    ):
        load_config(
            RunConfig,
            None,
            ["head.kind=medusa", "train.lora.enabled=true", "train.features_dir=[x]"],
        )


def test_a_resumed_run_reads_its_saved_config_under_the_old_keys(tmp_path: Path):
    """A run whose config.yaml was saved with train.loss, train.decay and train.lora resumes under
    the same settings as head.medusa.*; a changed LoRA setting is refused, a changed loss or decay
    is allowed (as it was)."""
    from headway.train.resume import check_same_run

    cfg = load_config(RunConfig, None, [*MEDUSA2, "head.medusa.loss=kl"])
    saved = OmegaConf.to_container(OmegaConf.structured(cfg))
    medusa = saved["head"]["medusa"]
    saved["train"].update(
        loss=medusa.pop("loss"), decay=medusa.pop("decay"), lora=medusa.pop("lora")
    )
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    check_same_run(tmp_path / "config.yaml", cfg)
    check_same_run(
        tmp_path / "config.yaml", load_config(RunConfig, None, [*MEDUSA2, "head.medusa.decay=0.5"])
    )
    with pytest.raises(HeadwayError, match=r"\(head changed\)"):
        check_same_run(
            tmp_path / "config.yaml",
            load_config(RunConfig, None, [*MEDUSA2, "head.medusa.lora.r=8"]),
        )


@pytest.mark.parametrize("medusa2", [False, True])
def test_a_medusa_head_saved_before_its_training_settings_moved_loads(
    tmp_path: Path, medusa2: bool
):
    """A head directory written before head.medusa held loss, decay and lora (its config.json has
    none of them; a Medusa-2 one says adapted_target) loads with the defaults, LoRA on for Medusa-2;
    a new one keeps its own."""
    from headway.heads.config import LoraConfig, MedusaConfig
    from headway.kinds.checkpoint import save_head
    from headway.kinds.registry import build_head

    lora = LoraConfig(enabled=medusa2, r=4, target_modules=["q_proj"])
    cfg = MedusaConfig(
        num_heads=2, lm_head="reduced", draft_vocab_size=16, loss="kl", decay=0.5, lora=lora
    )
    torch.manual_seed(0)
    heads = build_head("medusa", cfg, 8, 32)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    fingerprint = {"id": "tiny"}
    new = save_head(
        heads, tmp_path / "new", fingerprint, {"adapted_target": "lora"} if medusa2 else {}
    )
    assert load_head(new, fingerprint).cfg == cfg  # saved with the head: config.json holds them
    config = json.loads((new / "config.json").read_text())
    for key in ("loss", "decay", "lora"):
        config["head"].pop(key)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(config))
    (old / "model.safetensors").write_bytes((new / "model.safetensors").read_bytes())
    again = load_head(old, fingerprint)
    assert (again.cfg.loss, again.cfg.decay, again.cfg.lora) == (
        "ce",
        0.8,
        LoraConfig(enabled=medusa2),
    )
    for k, v in heads.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0)


def test_dataset_from_another_target_is_refused(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.train.loop import train

    with pytest.raises(
        HeadwayError, match=r"dataset .* was made by target .* not the configured target"
    ):
        train(train_cfg(tiny_dirs["mistral"], tiny_data, tmp_path / "run"))
    with pytest.raises(HeadwayError, match="no training data"):
        train(
            load_config(
                RunConfig, None, [f"target.name_or_path={tiny_dirs['llama']}", "target.device=cpu"]
            )
        )


def test_training_measures_rank_accuracy_for_the_tree_builder(tiny_dirs, tiny_data, tmp_path: Path):
    from headway.inference.api import SpeculativeDecoder
    from headway.train.loop import train

    head_dir = train(
        train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "run", "train.max_steps=2")
    )
    acc = json.loads((head_dir / "config.json").read_text())["rank_accuracy"]
    assert len(acc) == 3 and len(acc[0]) == 8 and all(0 <= a <= 1 for row in acc for a in row)
    assert all(sum(row) <= 1 + 1e-6 for row in acc)  # at most one rank can be right
    cfg = float64_run(tiny_dirs["llama"], "inference.tree_nodes=6", "inference.max_new_tokens=12")
    decoder = SpeculativeDecoder.load(head_dir, cfg)
    # the hybrid drafter's neural half is the tree built from it
    assert decoder.drafter.neural.tree.size == 7
    result = decoder.chat("Question 1: what is 1 plus 2?")
    assert result.spec.tokens == result.plain.tokens


def test_bench_command_reports_and_writes(tiny_dirs, tiny_data, tmp_path: Path):
    import subprocess
    import sys

    from headway.train.loop import train

    head_dir = train(
        train_cfg(tiny_dirs["llama"], tiny_data, tmp_path / "run", "train.max_steps=2")
    )
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"turns": [f"Question {i}?", "more?"], "category": c}) + "\n"
            for i, c in enumerate(["math", "writing", "math"])
        )
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "headway",
            "bench",
            "--head",
            str(head_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "b.json"),
            f"target.name_or_path={tiny_dirs['llama']}",
            "target.num_threads=1",
            "target.dtype=float64",
            "inference.max_new_tokens=12",
            "inference.tree=[[0],[1],[0,0]]",
            "bench.drafters=[neural,ngram]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads((tmp_path / "b.json").read_text())
    o = result["overall"]
    # both turns of each record: 6 rows; later turns continue from the plain answer
    assert o["prompts"] == 6 and set(result["by_category"]) == {"math", "writing"}
    # by prompt length too: the buckets together hold every prompt, each bucket its own summary
    assert sum(s["prompts"] for s in result["by_prompt_length"].values()) == 6
    assert [r["turn"] for r in result["per_prompt"]] == [1, 2] * 3
    assert (
        result["per_prompt"][1]["prompt_tokens"]
        > result["per_prompt"][0]["prompt_tokens"] + result["per_prompt"][0]["plain"]["tokens"]
    )
    others = ["headway_neural", "headway_ngram", "hf_generate", "hf_prompt_lookup"]
    # speculative: the default hybrid drafter
    assert result["methods"] == ["plain", *others, "speculative"]
    assert result["settings"]["drafter"]["drafter"] == "hybrid" and result["settings"]["drafter"][
        "tree"
    ] == [
        [0],
        [1],
        [0, 0],
    ]
    # float64: every method writes exactly plain greedy's tokens
    assert o["match_rate"] == 1.0 and o["matches_plain"] == {
        m: 1.0 for m in [*others, "speculative"]
    }
    assert set(o["speedup_over"]) == {"plain", *others}
    # tau of every Headway method that verifies drafts (HF's decoders report no target forwards)
    assert set(o["tau_by_method"]) == {"headway_neural", "headway_ngram", "speculative"}
    assert o["tau_by_method"]["speculative"] == o["tau"]
    assert "tau by method: Headway neural tree" in (tmp_path / "b.md").read_text()
    # which branch kind the accepted drafts came from, per category and overall (shares)
    for s in [o, *result["by_category"].values()]:
        assert s["accepted_from"] is None or sum(s["accepted_from"].values()) == pytest.approx(1.0)
    counts = [r["speculative"]["sources"] for r in result["per_prompt"]]
    if any(counts):
        assert "Accepted draft tokens by branch" in (tmp_path / "b.md").read_text()
    assert o["speedup_over"]["hf_generate"] == pytest.approx(
        o["tok_s"]["speculative"] / o["tok_s"]["hf_generate"]
    )
    assert (
        len(o["acceptance_by_depth"]) == 12 and result["settings"]["threads"] == 1
    )  # the n-gram branches' depth
    md = (tmp_path / "b.md").read_text()
    assert "| **overall** | 6 |" in md and "speedup vs HF prompt lookup" in md
    ms = o["ms_per_token"]
    assert ms["drafting"] > 0 and ms["verification"] > 0 and "Per generated token: drafting" in md
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_subset_takes_the_first_prompts_of_each_category():
    from types import SimpleNamespace

    from headway.inference.bench.run import per_category

    convs = [SimpleNamespace(id=i, meta={"category": c}) for i, c in enumerate("aaabbbc")]
    assert [c.id for c in per_category(convs, 2)] == [0, 1, 3, 4, 6]


def test_length_buckets_hold_each_prompt_once_by_its_token_count():
    from headway.inference.bench.run import length_buckets

    rows = [{"prompt_tokens": n} for n in (10, 255, 256, 999, 1000, 2999, 3000, 9000)]
    got = length_buckets(rows, [0, 256, 1000, 2000, 3000])
    assert {k: [r["prompt_tokens"] for r in v] for k, v in got.items()} == {
        "0-255": [10, 255],
        "256-999": [256, 999],
        "1000-1999": [1000],
        "2000-2999": [2999],
        "3000+": [3000, 9000],
    }
    assert list(length_buckets(rows[:2], [0, 256])) == ["0-255"]  # empty buckets are left out

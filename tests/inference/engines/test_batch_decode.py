"""The static engine (distill.engine=static, inference/engines/batch.py): batched slots on one
static KV cache, refilled as answers end. Its greedy answers equal Hugging Face `generate`'s at
batch 1 for every prompt, in float64 on the four tiny architectures, whatever the batch size and
refill order; its sampling draws the target's distribution; on fake CUDA its decode step reads
nothing from the host and mixes no device."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from headway.data_scripts.distill import engine_name, load_distilled
from headway.data_scripts.engines import HFEngine, SamplingSettings, StaticEngine
from headway.errors import HeadwayError
from headway.inference.engines.batch import BatchDecoder, sample_rows
from headway.inference.engines.cuda.sync_guard import HostReads, Uploads
from headway.target.chat import ChatFormat
from tests.data_scripts.test_distill import run, run_cfg, write_prompts_file
from tests.helpers.dataset_checks import mask_spans
from tests.helpers.decode_helpers import load64
from tests.helpers.fake_cuda import fake_cuda, to_fake_cuda

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


def _prompts(t, rng: random.Random, count: int, longest: int) -> list[list[int]]:
    v = t.config.vocab_size
    return [[rng.randrange(3, v) for _ in range(rng.randrange(1, longest))] for _ in range(count)]


def _reference(t, prompts, stops, new):
    """HF `generate`, one prompt at a time (the hf engine at batch 1)."""
    engine = HFEngine(t.model, t.tokenizer.pad_token_id or 0, stops, batch_size=1, cache="dynamic")
    return engine.generate(prompts, SamplingSettings(max_new_tokens=new), 0)


def _stop_of_many_lengths(answers: list[list[int]]) -> int:
    """The token whose first occurrences cut `answers` at the most distinct lengths, some uncut."""

    def lengths(x: int) -> list[int]:
        return [a.index(x) + 1 if x in a else len(a) + 1 for a in answers]

    uncut = [x for a in answers for x in a if max(lengths(x)) > len(answers[0])]
    return max(uncut, key=lambda x: len(set(lengths(x))))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_answers_equal_hf_generate_whatever_the_batch_and_refill_order(tiny_dirs, arch):
    t = load64(tiny_dirs[arch])
    rng = random.Random(1)
    prompts = _prompts(t, rng, 9, 24)
    if arch == "gemma3":  # a prompt past the tiny Gemma-3's 128-token sliding window
        prompts[2] = [rng.randrange(3, t.config.vocab_size) for _ in range(140)]
    # a stop token that ends answers at several lengths, and leaves some to run to max_new_tokens
    free = [g.token_ids for g in _reference(t, prompts, [], 16)]
    stops = [_stop_of_many_lengths(free)]
    ref = _reference(t, prompts, stops, 16)
    lengths = {len(g.token_ids) for g in ref}
    # (the tiny llama repeats one token per prompt: its answers end at once or run to the cap)
    assert (
        len(lengths) >= 2 and any(g.finished for g in ref) and not all(g.finished for g in ref)
    ), lengths
    s = SamplingSettings(max_new_tokens=16)
    for batch in (1, 3, 8):
        engine = StaticEngine(t.model, stops, batch, 192, check_every=3, span_block=16)
        got = engine.generate(prompts, s, 0)
        assert [(g.token_ids, g.finished) for g in got] == [
            (g.token_ids, g.finished) for g in ref
        ], batch
        # another refill order: the same answer for each prompt
        order = list(range(len(prompts)))
        random.Random(batch).shuffle(order)
        again = engine.generate([prompts[i] for i in order], s, 0)
        assert [g.token_ids for g in again] == [ref[i].token_ids for i in order], batch
    assert engine.decoder.steps > 0


def test_sample_rows_draws_the_distribution():
    """Inverse-CDF sampling from uniforms: chi-square against the probabilities (a draw that ignores
    the row's own distribution, taking the first row's for every row, fails)."""
    from collections import Counter

    from tests.inference.test_sampling import chi_square_p

    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.2, 0.0, 0.3], [0.05, 0.05, 0.6, 0.3]], dtype=torch.float64)
    n = 20000
    u = torch.rand(n, generator=g, dtype=torch.float64)

    def p_value(draws, row):
        counts = Counter((int(x),) for x in draws)
        return chi_square_p(counts, {(k,): float(p) for k, p in enumerate(probs[row])}, n)

    for row in range(2):
        draws = sample_rows(probs[row].expand(n, -1), u)
        assert (draws != 2).all() if row == 0 else True  # a token of probability 0 is never drawn
        assert p_value(draws, row) > 1e-3
    assert (
        p_value(sample_rows(probs[0].expand(n, -1), u), 1) < 1e-6
    )  # row 0's draws against row 1's law


def test_sampling_is_seeded_and_keeps_the_stop_rule(tiny_dirs):
    t = load64(tiny_dirs["qwen2"])
    prompts = _prompts(t, random.Random(2), 5, 12)
    stops = [7, 11]
    engine = StaticEngine(t.model, stops, 3, 64, check_every=2, span_block=16)
    s = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=0.9)
    a, b, c = (engine.generate(prompts, s, seed) for seed in (5, 5, 6))
    assert [g.token_ids for g in a] == [g.token_ids for g in b] != [g.token_ids for g in c]
    for g in a + c:
        assert all(x not in stops for x in g.token_ids[:-1]) and len(g.token_ids) <= 12
        assert g.finished == (g.token_ids[-1] in stops)
    # then greedy again on the same engine: the captured rule is dropped with the sampling settings
    greedy = engine.generate(prompts, SamplingSettings(max_new_tokens=12), 0)
    assert [g.token_ids for g in greedy] == [g.token_ids for g in _reference(t, prompts, stops, 12)]


def test_fake_cuda_decode_step_reads_nothing_and_mixes_no_device(tiny_dirs, monkeypatch):
    """The decode step with every tensor on "cuda" (FakeTensorMode): no device mismatch, and no host
    read or upload inside a step; the loop reads the host only at its finished checks."""
    t = load64(tiny_dirs["llama"])
    t.model.float()
    reads, traffic = [], []

    def read(tensor):
        reads.append(tuple(tensor.shape))
        if tensor.dtype == torch.bool:  # the finished check: every slot done
            return [False] * tensor.shape[0]
        return [[2] + [1] * (tensor.shape[1] - 1) for _ in range(tensor.shape[0])]

    monkeypatch.setattr(BatchDecoder, "read", staticmethod(read))
    real = BatchDecoder._step

    def counted(self, end):
        with HostReads() as host, Uploads() as up:
            out = real(self, end)
        traffic.append((host.count, up.count))
        return out

    monkeypatch.setattr(BatchDecoder, "_step", counted)
    with fake_cuda():
        to_fake_cuda(t.model)
        decoder = BatchDecoder(t.model, 4, 64, [2], check_every=3, span_block=16, graphs=False)
        answers = decoder.generate([[5, 6, 7], [8, 9], [10], [11, 12, 13, 14], [15, 16]], 8)
    assert answers == [[1, 1]] * 5
    assert len(traffic) == 6 and set(traffic) == {(0, 0)}  # two rounds of 3 steps
    assert reads == [
        (4,),
        (4, 65),
        (4,),
        (1, 65),
    ]  # each round: the check, then the finished answers


def test_static_distill_writes_the_targets_greedy_answers(tiny_dirs, tmp_path: Path):
    """`headway distill` with distill.engine=static: multi-turn answers, each span the target's
    greedy continuation at batch 1; the manifest names the engine and its batch."""
    from tests.helpers.dataset_checks import greedy_reference

    model_dir = tiny_dirs["mistral"]
    prompts = write_prompts_file(tmp_path / "p.jsonl")
    out = run(
        run_cfg(
            model_dir, prompts, tmp_path / "ds", "distill.engine=static", "distill.chunk_size=0"
        )
    )
    ds, manifest = load_distilled(out)
    assert manifest["engine"] == "static" and manifest["engine_batch_size"] == 3
    t = load64(model_dir)
    fmt = ChatFormat(t.tokenizer, None, t.generation_config)
    for row in ds:
        ids = row["input_ids"]
        for start, end in mask_spans(row["loss_mask"]):
            assert ids[start:end] == greedy_reference(
                t.model, ids[:start], 12, fmt.stop_ids, t.tokenizer.pad_token_id
            )


def test_auto_picks_static_only_on_cuda(tiny_dirs, tmp_path: Path):
    from headway.data_scripts.config import DistillConfig

    t = load64(tiny_dirs["llama"])
    assert engine_name(DistillConfig(), t) == "hf"  # a CPU target: today's choice
    assert engine_name(DistillConfig(engine="static"), t) == "static"
    with fake_cuda():
        to_fake_cuda(t.model)
        assert engine_name(DistillConfig(), t) == "static"  # CUDA without vLLM


def test_static_engine_refuses_what_it_does_not_run(tiny_dirs):
    t = load64(tiny_dirs["llama"])
    t.model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(HeadwayError, match="distill.engine=static runs the CUDA backend's targets"):
        StaticEngine(t.model, [2], 2, 64)


def test_the_hf_engine_with_a_static_cache_runs_fixed_shapes(tiny_dirs):
    """distill.hf_cache=static: every generate call sees batch_size rows and a bucketed width (so it
    compiles once per width), and the answers stay batch-1 greedy's."""
    t = load64(tiny_dirs["qwen2"])
    prompts = _prompts(t, random.Random(4), 7, 30)
    shapes = []
    real = t.model.generate

    def recorded(**kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return real(**kwargs)

    t.model.generate = recorded
    engine = HFEngine(t.model, 0, [7], batch_size=3, cache="static", width_bucket=16)
    got = engine.generate(prompts, SamplingSettings(max_new_tokens=8), 0)
    assert set(shapes) <= {(3, 16), (3, 32)} and len(shapes) == 3
    del t.model.generate
    assert [g.token_ids for g in got] == [g.token_ids for g in _reference(t, prompts, [7], 8)]

"""The GPU training review's findings (docs/gpu-review-training.md), each caught on the CPU: a micro-batch
with no loss row, the flex attention's compiles, one compute dtype through the head, the host's plan time, a
target that really shards."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from decode_helpers import load64
from test_eagle import random_head
from test_ttt import padded_batch
from train_helpers import small_run

from headway.heads.config import MedusaConfig
from headway.heads.medusa import MedusaHeads
from headway.train.distributed import Parallel
from headway.train.losses import COUNT, target_to_draft
from headway.train.metrics import MetricSums, read
from headway.train.objectives.eagle3 import Eagle3Objective
from headway.train.objectives.medusa import MedusaObjective


def test_answerless_prompts_are_dropped_at_load_and_counted(tiny_dirs, tmp_path, caplog):
    """Finding 3, as a new user meets it: 8 prompts longer than train.max_length among 8 short ones, no dedup.
    Their truncated samples have no answer token; they were clustered by the length windows into micro-batches
    with no loss row, whose backward raised at step 3."""
    from headway.config import load_config
    from headway.data_scripts.distill import distill
    from headway.run_config import RunConfig
    from headway.train.loop import train

    rows = [
        {"instruction": "Tell me about " + " and ".join(f"topic {i}-{k}" for k in range(30))}
        for i in range(8)
    ]
    rows += [{"instruction": f"What is {i} plus {i}?"} for i in range(8)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    llama = tiny_dirs["llama"]
    cfg = load_config(
        RunConfig,
        None,
        [
            f"target.name_or_path={llama}",
            "target.device=cpu",
            "target.num_threads=1",
            f"prompts.path={tmp_path / 'p.jsonl'}",
            f"distill.output_dir={tmp_path / 'ds'}",
            "distill.engine=hf",
            "distill.max_new_tokens=8",
            "distill.batch_size=8",
        ],
    )
    data = distill(cfg.target, cfg.prompts, cfg.distill, cfg.magpie)
    extra = ("head.kind=eagle3", "train.max_length=48", "train.dedup=none", "train.eval_every=0")
    with caplog.at_level(logging.INFO):
        train(small_run(llama, data, tmp_path / "run", *extra, "train.save_every=0", "train.max_steps=4"))
    assert "dropped 8 sequences with no answer token within train.max_length=48" in caplog.text
    logged = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]


def _medusa(t) -> MedusaHeads:
    torch.manual_seed(0)
    cfg = MedusaConfig(num_heads=3, lm_head="own")
    return MedusaHeads(cfg, t.config.hidden_size, t.config.vocab_size).double()


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "medusa-chunked"])
def test_a_micro_batch_with_no_loss_row_backpropagates_with_the_same_metric_keys(tiny_dirs, kind: str):
    """Finding 3: an objective on a micro-batch whose loss mask is all zero gives a loss with a graph (its
    backward reaches the read-out: every rank reduces the same parameters), zero metrics, and exactly the
    metric keys of a micro-batch with answers (the ranks' all-reduce of them has one length)."""
    t = load64(tiny_dirs["llama"])
    batch, feats = padded_batch(t)
    empty = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    if kind == "eagle3":
        heads = random_head(t, "eagle3").train()
        objective = Eagle3Objective(heads.cfg)
        t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
        readout = heads.lm_head.weight
    else:
        heads = _medusa(t).train()
        objective = MedusaObjective(heads.cfg, loss_chunk=4 if kind == "medusa-chunked" else 0)
        t2d, readout = None, heads.lm_heads[0].weight
    keys = []
    for b in (batch, empty):
        heads.zero_grad()
        loss, metrics = objective(heads, b, feats, t2d)
        loss.backward()  # raised "element 0 of tensors does not require grad" on the empty batch
        assert readout.grad is not None
        keys.append(sorted(metrics))
    assert keys[0] == keys[1] and any(k.endswith(COUNT) for k in keys[0])
    assert float(loss.detach()) == 0.0 and all(
        float(v) == 0.0 for k, v in metrics.items() if "top" in k or COUNT in k
    )


def test_metrics_average_as_sums_over_counts():
    """A micro-batch's metric weighs by its row count: one with no row adds nothing to the mean; a value with
    no count (the loss) is a plain mean over micro-batches."""
    sums = MetricSums()
    sums.add({"top1": torch.tensor(0.0), "top1" + COUNT: torch.tensor(0.0), "loss": torch.tensor(1.0)})
    sums.add({"top1": torch.tensor(0.5), "top1" + COUNT: torch.tensor(4.0), "loss": torch.tensor(3.0)})
    assert read(sums.values(), Parallel()) == {"loss": 2.0, "top1": 0.5}


def count_flex_compiles(
    t, batches: int, buckets: tuple[int, ...], micro: int = 4, seed: int = 0, longest: int = 250
) -> list:
    """The (Q, K) shapes Dynamo compiles flex attention at (backend "eager", static shapes, as on CUDA) over
    `batches` planned EAGLE-3 micro-batches of `micro` stub sequences of 20 to `longest` tokens (a third
    prompt, the rest answer) in the training stream's length windows, forward without gradients on the tiny
    target `t`'s head."""
    from torch.nn.attention.flex_attention import flex_attention

    from headway.train import ttt_flex
    from headway.train.data import Sample, batch_at, collate
    from headway.train.ttt import ttt_unroll

    compiled: list = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        q, k = [x for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 4][
            :2
        ]
        compiled.append((q.shape[2], k.shape[2]))
        return gm.forward

    flex = torch.compile(flex_attention, dynamic=False, backend=backend)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, longest, (256,), generator=g).tolist()
    samples = [Sample([5] * n, [0] * (n // 3) + [1] * (n - n // 3)) for n in lengths]
    heads = random_head(t, "eagle3").eval()
    objective = Eagle3Objective(heads.cfg, ttt_attention="flex", flex_buckets=buckets)
    torch._dynamo.reset()
    real = ttt_flex._compiled
    ttt_flex._compiled = lambda compile: flex
    try:
        with torch.no_grad():
            for k in range(batches):
                batch = collate(batch_at(samples, k * micro, micro, seed=1, window=64), 0)
                plan = objective.plan(batch)
                hidden = torch.randn(*batch["input_ids"].shape, heads.fc.weight.shape[0], dtype=torch.float64)
                kept = (plan["ttt_index"], plan["ttt_kept"])
                ttt_unroll(
                    heads,
                    batch["input_ids"],
                    batch["attention_mask"],
                    hidden,
                    3,
                    kept=kept,
                    attention="flex",
                    buckets=objective.flex_buckets,
                )
    finally:
        ttt_flex._compiled = real
        torch._dynamo.reset()
    return compiled


def test_flex_attention_compiles_once_per_bucket_shape_and_a_limit_hit_raises(tiny_dirs):
    """Finding 1: with the head's length and kept count padded to buckets, 10 planned micro-batches compile
    flex at no shape outside `flex_shapes`, no more often than it counts; unbucketed, every new length is a
    new compile, and past the recompile limit `limit_compiles` makes Dynamo raise (it used to run flex
    eagerly: dense fp32 scores, silently)."""
    from headway.train.ttt_flex import flex_shapes, limit_compiles

    config = torch._dynamo.config
    saved = {k: getattr(config, k) for k in ("recompile_limit", "fail_on_recompile_limit_hit")}
    t = load64(tiny_dirs["llama"])
    buckets = (128, 256)
    allowed = flex_shapes(buckets, 3)
    try:
        limit_compiles(len(allowed))
        shapes = count_flex_compiles(t, 10, buckets)
        assert set(shapes) <= {(n, t + j * n) for t, n, j in allowed} and 3 <= len(shapes) <= len(allowed)
        config.recompile_limit = 3
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            count_flex_compiles(t, 10, ())
    finally:
        for k, v in saved.items():
            setattr(config, k, v)


def test_flex_attention_padded_to_buckets_gives_the_unpadded_loss(tiny_dirs):
    """The padding to flex's buckets is masked out: the same loss and metrics in float64."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3").eval()
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
    out = []
    for buckets in ((), (128, 256)):
        objective = Eagle3Objective(heads.cfg, ttt_attention="flex", flex_buckets=buckets)
        with torch.no_grad():
            out.append(objective(heads, {**batch, **objective.plan(batch)}, feats, t2d))
    assert out[1][0].dtype == torch.float64
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-10, atol=1e-12)
    assert out[1][1].keys() == out[0][1].keys()
    for k in out[0][1]:
        torch.testing.assert_close(out[1][1][k], out[0][1][k], rtol=1e-10, atol=1e-12)


def plan_steps(n: int, steps: int, micro: int = 4, world: int = 8) -> tuple[list, list, list]:
    """The host plans of `steps` optimizer steps (2 micro-batches of `micro` x `world` sequences: rank 0's
    share) over `n` stub sequences of 20-1,000 tokens, with a plan-nothing objective, and the seconds per
    micro-batch each step took (the first includes the epoch's order): the host's work per micro-batch at
    that corpus size. Returns (samples, plans, seconds per micro-batch of each step)."""
    import time
    from types import SimpleNamespace

    from headway.train.data import Sample
    from headway.train.objectives.common import Objective
    from headway.train.step import TrainStep

    class Stub(Objective):
        def flops(self, heads, plan, target) -> float:
            return 0.0

        def __call__(self, heads, batch, feats, t2d):
            raise AssertionError("planning only")

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 1000, (n,), generator=g).tolist()
    samples = [Sample([5] * k, [0] * (k // 2) + [1] * (k - k // 2)) for k in lengths]
    tc = SimpleNamespace(micro_batch_size=micro, grad_accum=2, seed=0, length_window=128, packing=False)
    par = Parallel(world_size=world)
    run = SimpleNamespace(target=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0)), plan=Stub(None))
    step = TrainStep(run, None, samples, tc, par, None)
    plans, seconds, consumed = [], [], 0
    for k in range(steps):
        started = time.perf_counter()
        plans.append(step.plan(k + 1, consumed))
        seconds.append((time.perf_counter() - started) / tc.grad_accum)
        consumed = plans[-1].end
    return samples, plans, seconds


def test_the_host_plans_a_micro_batch_without_reading_the_whole_dataset(monkeypatch):
    """Finding 4: each epoch's order is computed once, not once per sequence read (it used to rebuild and
    hash a tuple of every length per sequence: O(dataset) per micro-batch); the stream is unchanged."""
    from headway.train import data

    calls = []
    real = data.sample_order
    monkeypatch.setattr(data, "sample_order", lambda *a: calls.append(a[2]) or real(*a))
    samples, plans, _ = plan_steps(2_000, 40)  # 2,560 sequences read: past the first epoch
    assert calls == [0, 1]
    for k in (0, 1, 63):  # rank 0's share of global micro-batch k (of 32 sequences) is the stream's
        assert [id(s) for s in plans[k // 2].micro[k % 2][1]] == [
            id(s) for s in data.batch_at(samples, 32 * k, 32, 0, 128)[:4]
        ]


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed"])
def test_flex_attention_gets_one_dtype_on_every_backend(tiny_dirs, backend: str, monkeypatch):
    """Finding 2, under bf16 autocast (the CPU's: a CPU-only torch turns CUDA autocast off, so a fake CUDA
    device cannot show it; flex's forward runs on CPUs): DDP keeps float32 parameters, and the head's rotary
    embedding then promotes q and k past a bf16 v (flex raised, or ran in float32, on GPUs); FSDP2's
    mixed-precision policy and DeepSpeed's bf16 gather them in bf16. At every flex kernel call q, k and v
    are one dtype, the autocast's."""
    from headway.train import ttt_flex
    from headway.train.objectives import Features

    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3").float().train()
    t.model.float()
    if backend != "ddp":  # MixedPrecisionPolicy(param_dtype=bf16) / DeepSpeed bf16: the forward's parameters
        heads.to(torch.bfloat16)
    seen = []

    def recorder(compile: bool):
        def run(q, k, v, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype))
            return ttt_flex.flex_attention(q, k, v, **kwargs)

        return run

    monkeypatch.setattr(ttt_flex, "_compiled", recorder)
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
    objective = Eagle3Objective(heads.cfg, ttt_attention="flex", flex_buckets=(128,), loss_chunk=8)
    hidden = {i: h.to(torch.bfloat16) for i, h in feats.hidden.items()}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        planned = {**batch, **objective.plan(batch)}
        objective(heads, planned, Features(hidden, model=t.model, argmax=batch["input_ids"]), t2d)
    assert len(seen) == heads.cfg.ttt_steps and set(seen) == {(torch.bfloat16,) * 3}

"""The GPU training review's findings (docs/gpu-review-training.md), each caught on the CPU: a
micro-batch with no loss row, the flex attention's compiles, one compute dtype through the head, the
host's plan time, a target that really shards."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from headway.heads.config import MedusaConfig
from headway.heads.medusa import MedusaHeads
from headway.train.distributed import Parallel
from headway.train.losses import COUNT, target_to_draft
from headway.train.metrics import MetricSums, read
from headway.train.objectives.eagle3 import Eagle3Objective
from headway.train.objectives.medusa import MedusaObjective
from tests.helpers.decode_helpers import load64
from tests.helpers.train_helpers import small_run
from tests.kinds.test_eagle import random_head
from tests.train.test_ttt import padded_batch


def test_answerless_prompts_are_dropped_at_load_and_counted(tiny_dirs, tmp_path, caplog):
    """Finding 3, as a new user meets it: 8 prompts longer than train.max_length among 8 short ones,
    no dedup. Their truncated samples have no answer token; they were clustered by the length
    windows into micro-batches with no loss row, whose backward raised at step 3."""
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
        train(
            small_run(
                llama, data, tmp_path / "run", *extra, "train.save_every=0", "train.max_steps=4"
            )
        )
    assert "dropped 8 sequences with no answer token within train.max_length=48" in caplog.text
    logged = [
        json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]


def _medusa(t) -> MedusaHeads:
    torch.manual_seed(0)
    cfg = MedusaConfig(num_heads=3, lm_head="own")
    return MedusaHeads(cfg, t.config.hidden_size, t.config.vocab_size).double()


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "medusa-chunked"])
def test_a_micro_batch_with_no_loss_row_backpropagates_with_the_same_metric_keys(
    tiny_dirs, kind: str
):
    """Finding 3: an objective on a micro-batch whose loss mask is all zero gives a loss with a
    graph (its backward reaches the read-out: every rank reduces the same parameters), zero metrics,
    and exactly the metric keys of a micro-batch with answers (the ranks' all-reduce of them has one
    length)."""
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
    """A micro-batch's metric weighs by its row count: one with no row adds nothing to the mean; a
    value with no count (the loss) is a plain mean over micro-batches."""
    sums = MetricSums()
    sums.add(
        {"top1": torch.tensor(0.0), "top1" + COUNT: torch.tensor(0.0), "loss": torch.tensor(1.0)}
    )
    sums.add(
        {"top1": torch.tensor(0.5), "top1" + COUNT: torch.tensor(4.0), "loss": torch.tensor(3.0)}
    )
    assert read(sums.values(), Parallel()) == {"loss": 2.0, "top1": 0.5}


def count_flex_compiles(
    t, batches: int, buckets: tuple[int, ...], micro: int = 4, seed: int = 0, longest: int = 250
) -> list:
    """The (Q, K) shapes Dynamo compiles flex attention at (backend "eager", static shapes, as on
    CUDA) over `batches` planned EAGLE-3 micro-batches of `micro` stub sequences of 20 to `longest`
    tokens (a third prompt, the rest answer) in the training stream's length windows, forward
    without gradients on the tiny target `t`'s head."""
    from torch.nn.attention.flex_attention import flex_attention

    from headway.train import ttt_flex
    from headway.train.data import Sample, batch_at, collate
    from headway.train.ttt import ttt_unroll

    compiled: list = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        q, k = [
            x
            for x in inputs
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 4
        ][:2]
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
                hidden = torch.randn(
                    *batch["input_ids"].shape, heads.fc.weight.shape[0], dtype=torch.float64
                )
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
    """Finding 1: with the head's length and kept count padded to buckets, 10 planned micro-batches
    compile flex at no shape outside `flex_shapes`, no more often than it counts; unbucketed, every
    new length is a new compile, and past the recompile limit `limit_compiles` makes Dynamo raise
    (it used to run flex
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
        assert set(shapes) <= {(n, t + j * n) for t, n, j in allowed} and 3 <= len(shapes) <= len(
            allowed
        )
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


def plan_steps(
    n: int, steps: int, micro: int = 4, world: int = 8, ahead: str = "none"
) -> tuple[list, list, list]:
    """The host plans of `steps` optimizer steps (2 micro-batches of `micro` x `world` sequences:
    rank 0's share) over `n` stub sequences of 20-1,000 tokens, with a plan-nothing objective, and
    the seconds per micro-batch each step took (the first includes the epoch's order): the host's
    work per micro-batch at that corpus size. Returns (samples, plans, seconds per micro-batch of
    each step)."""
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
    tc = SimpleNamespace(
        micro_batch_size=micro,
        grad_accum=2,
        seed=0,
        length_window=128,
        packing=False,
        plan_ahead=ahead,
    )
    par = Parallel(world_size=world)
    run = SimpleNamespace(
        target=SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0)),
        plan=Stub(None),
        device=torch.device("cpu"),
    )
    step = TrainStep(run, None, samples, tc, par, None)
    if ahead != "none":
        return samples, step, []
    plans, seconds, consumed = [], [], 0
    for k in range(steps):
        started = time.perf_counter()
        plans.append(step.plan(k + 1, consumed))
        seconds.append((time.perf_counter() - started) / tc.grad_accum)
        consumed = plans[-1].end
    return samples, plans, seconds


def test_the_host_plans_a_micro_batch_without_reading_the_whole_dataset(monkeypatch):
    """Finding 4: each epoch's order is computed once, not once per sequence read (it used to
    rebuild and hash a tuple of every length per sequence: O(dataset) per micro-batch); the stream
    is unchanged."""
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


def test_the_next_step_is_planned_on_a_thread_while_this_one_runs():
    """Finding 4's background planning (train.plan_ahead=thread; auto on CUDA): step k+1's host
    work runs on the planning thread while step k's device work does, and gives the plans planning
    between steps gives."""
    import threading
    from types import SimpleNamespace

    samples, step, _ = plan_steps(400, 4, ahead="thread")
    _, sync, _ = plan_steps(400, 4)
    made_on, seen = {}, []
    planner = step.plan

    def plan(k, consumed):
        made_on[k] = threading.current_thread().name
        return planner(k, consumed)

    def run_planned(plan):
        # the next step's plan was asked for before this step's device work began
        seen.append((plan, step.pending is not None and step.pending[0] == plan.step + 1))
        return SimpleNamespace(end=plan.end)

    step.plan, step.run_planned = plan, run_planned
    step.finite = SimpleNamespace(after_update=lambda outcome: None)
    consumed = 0
    for k in range(1, 5):
        consumed = step(k, consumed).end
    assert made_on[1] == threading.main_thread().name
    assert all(made_on[k].startswith("headway-plan") for k in (2, 3, 4))
    assert all(ahead for _, ahead in seen)
    for (plan, _), other in zip(seen, sync):
        assert [[len(x.input_ids) for x in m[1]] for m in plan.micro] == [
            [len(x.input_ids) for x in m[1]] for m in other.micro
        ]
        assert plan.end == other.end


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed"])
def test_flex_attention_gets_one_dtype_on_every_backend(tiny_dirs, backend: str, monkeypatch):
    """Finding 2, under bf16 autocast (the CPU's: a CPU-only torch turns CUDA autocast off, so a
    fake CUDA device cannot show it; flex's forward runs on CPUs): DDP keeps float32 parameters, and
    the head's rotary embedding then promotes q and k past a bf16 v (flex raised, or ran in float32,
    on GPUs); FSDP2's mixed-precision policy and DeepSpeed's bf16 gather them in bf16. At every flex
    kernel call q, k and v are one dtype, the autocast's."""
    from headway.train import ttt_flex
    from headway.train.objectives import Features

    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3").float().train()
    t.model.float()
    # MixedPrecisionPolicy(param_dtype=bf16) / DeepSpeed bf16: the forward's parameters
    if backend != "ddp":
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


def _recompute_inputs(seed: int = 0):
    """A recompute attention call's inputs: 2 query groups, 6 queries at kept positions, 8 real
    keys, one earlier step; float32, requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G, N, T, D = 1, 2, 2, 6, 8, 16
    q = torch.randn(B, Hkv, G, N, D, generator=g)
    k0, v0 = torch.randn(B, Hkv, T, D, generator=g) * 2, torch.randn(B, Hkv, T, D, generator=g)
    kd, vd = (
        torch.randn(B, Hkv, 1, N, D, generator=g) * 2,
        torch.randn(B, Hkv, 1, N, D, generator=g),
    )
    index = torch.tensor([[1, 2, 3, 4, 6, 7]])
    real = torch.ones(B, T, dtype=torch.bool)
    tensors = [x.requires_grad_() for x in (q, k0, v0, kd, vd)]
    return tensors, index, real, torch.zeros((0,), dtype=torch.long)


def test_recomputed_attention_runs_its_backward_in_the_forward_autocast_dtype():
    """Finding 6: train.ttt_attention=recompute's backward (called outside the objective's autocast)
    recomputed the scores in float32 against a log-sum-exp of the forward's bf16 scores. Every
    matmul of its backward now runs in the forward's autocast dtype (torch.amp.custom_bwd's rule),
    as the forward's did."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from headway.train.ttt_recompute import _Attention

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                self.dtypes.add(out.dtype)
            return out

    (q, k0, v0, kd, vd), index, real, doc = _recompute_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _Attention.apply(q, k0, v0, kd, vd, index, real, doc, 0.25, 4)
    seen = Matmuls()
    with seen:
        out.float().square().sum().backward()
    assert seen.dtypes == {torch.bfloat16}
    assert all(x.grad is not None and x.grad.isfinite().all() for x in (q, k0, v0, kd, vd))


def test_cache_features_loads_the_target_in_the_dtype_training_does(
    monkeypatch, tiny_dirs, tmp_path
):
    """Finding 7: `cache-features` loaded the target in target.dtype (float32 by auto) where online
    training on CUDA runs it in bfloat16, so a GPU's cache held other features than its online run.
    Both resolve train.target_dtype with one rule now; cache-features' load is checked with the
    device faked."""
    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.train import feature_cache
    from headway.train.feature_cache import run_cache_features, training_target_dtype

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert training_target_dtype("auto", "auto", cuda) == "bfloat16"
    assert training_target_dtype("auto", "float64", cpu) == "float64"
    assert training_target_dtype("float32", "auto", cuda) == "float32"

    class Loaded(Exception):
        pass

    def load(target_cfg):
        raise Loaded(target_cfg.dtype)

    monkeypatch.setattr(feature_cache, "resolve_device", lambda name: cuda)
    monkeypatch.setattr(feature_cache, "load_target", load)
    cfg = load_config(
        RunConfig, None, [f"target.name_or_path={tiny_dirs['llama']}", "head.kind=eagle3"]
    )
    with pytest.raises(Loaded, match="bfloat16"):
        run_cache_features(cfg.target, cfg.head, cfg.features, ["unused"], 64)


def test_the_final_head_reuses_the_trained_vocabulary_map(tiny_dirs, monkeypatch):
    """Finding 9: under FSDP and DeepSpeed, rank 0 rebuilt the final head from scratch, counting
    every training sample's tokens (`token_frequencies`) while the other ranks waited in a barrier,
    only for the trained state to overwrite d2t. It takes the trained d2t now: no count after
    setup."""
    from types import SimpleNamespace

    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.train import loop, setup_heads

    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    state = {k: v.clone() for k, v in heads.state_dict().items()}
    state["d2t"] = torch.sort(torch.randperm(t.config.vocab_size)[:96]).values
    counted = []
    monkeypatch.setattr(
        setup_heads, "token_frequencies", lambda *a: counted.append(1) or torch.ones(999)
    )
    monkeypatch.setattr(loop, "gather_state", lambda *a: (state, None, None))
    cfg = load_config(
        RunConfig,
        None,
        ["head.kind=eagle3", "head.eagle3.draft_vocab_size=96", "head.eagle3.ttt_steps=3"],
    )
    par = SimpleNamespace(backend="fsdp", is_main=True)
    final = loop._final_heads(cfg, t, [], None, heads, None, par)
    assert counted == []
    assert torch.equal(final.d2t, state["d2t"])


def test_the_chunked_loss_casts_the_weight_once_and_computes_no_gradient_in_evaluation():
    """Finding 10: the chunked vocabulary loss cast the lm_head weight in each chunk (autocast's
    casts in both of a chunk's matmuls: 2 per chunk), and under no_grad (evaluation) still formed
    grad_h and grad_w.
    Now: one cast per call, and only the forward's matmul per chunk under no_grad."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from headway.train.chunked_loss import chunked_draft_loss

    class Ops(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.casts, self.matmuls = shape, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
                self.casts += 1
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.matmuls += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    n, d, V, chunk = 16, 8, 40, 4
    weight = torch.randn(V, d, requires_grad=True)
    hidden = torch.randn(n, d, requires_grad=True)
    teacher, rows = torch.randn(n, V), torch.ones(n, dtype=torch.bool)
    ops = Ops((V, d))
    with ops, torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_draft_loss("soft_ce", hidden, weight, teacher, rows, chunk)
    assert ops.casts == 1
    ops = Ops((V, d))
    with ops, torch.no_grad():
        loss, _ = chunked_draft_loss("soft_ce", hidden, weight, teacher, rows, chunk)
    assert ops.matmuls == n // chunk
    with torch.no_grad():
        full, _ = chunked_draft_loss("soft_ce", hidden, weight, teacher, rows, n)
    assert torch.allclose(loss, full)


def test_an_explicit_gpu_index_under_torchrun_is_refused(monkeypatch):
    """Finding 15: target.device=cuda:0 under torchrun put every rank on GPU 0 (NCCL's duplicate
    GPU, or OOM). A rank whose index is not its local rank's is refused; auto (cuda:LOCAL_RANK)
    passes."""
    from headway.errors import HeadwayError
    from headway.train.distributed import rank_device

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(HeadwayError, match="names one GPU for 8 processes"):
        rank_device(torch.device("cuda", 0))


def test_the_process_group_waits_train_dist_timeout_min(monkeypatch):
    """Finding 9: the process group had torch's 10-minute timeout, with no setting, while rank 0
    alone exports and checkpoints; it is train.dist_timeout_min now."""
    import datetime

    from headway.train import distributed

    seen = {}

    class Stop(Exception):
        pass

    def init(backend, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", init)
    with pytest.raises(Stop):
        distributed.start("ddp", torch.device("cpu"), 45)
    assert seen["timeout"] == datetime.timedelta(minutes=45)


def test_start_up_passes_over_the_data_run_on_rank_0_only(tiny_dirs, monkeypatch):
    """Finding 16: train.dedup's MinHash pass (pure Python over every answer; set by the shipped
    recipe) and the draft vocabulary's token count ran on every rank. Rank 0 makes them and
    broadcasts the result: a rank 1 keeps the broadcast samples and builds its head with the
    broadcast d2t, counting nothing."""
    from types import SimpleNamespace

    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.train import loop, setup_heads
    from headway.train.data import Sample

    t = load64(tiny_dirs["llama"])
    cfg = load_config(
        RunConfig, None, ["head.kind=eagle3", "head.eagle3.draft_vocab_size=96", "train.dedup=near"]
    )
    ran = []
    monkeypatch.setattr(loop, "drop_duplicates", lambda *a: ran.append("dedup"))
    monkeypatch.setattr(setup_heads, "token_frequencies", lambda *a: ran.append("count"))
    samples = [(f"k{i}", Sample([1, 2, 3 + i], [0, 1, 1])) for i in range(5)]
    d2t = torch.sort(torch.randperm(t.config.vocab_size)[:96]).values
    sent = iter([[0, 2, 4], d2t])
    rank1 = SimpleNamespace(active=True, is_main=False, broadcast_object=lambda obj: next(sent))
    kept, dropped = loop.deduplicate(samples, cfg.train, rank1)
    assert [k for k, _ in kept] == ["k0", "k2", "k4"] and dropped == 2
    heads = loop.first_heads(cfg, t, [s for _, s in kept], rank1)
    assert torch.equal(heads.d2t, d2t) and ran == []

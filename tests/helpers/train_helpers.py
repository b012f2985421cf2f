"""A small, fast training run on a tiny target, and its logged losses."""

from __future__ import annotations

import json
from pathlib import Path

from headway.config import load_config
from headway.run_config import RunConfig


def small_run_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """small_run's settings as key=value overrides (for load_config or the command line): 6 steps of
    2 x 2 sequences, eval and checkpoint every 3, float32; `extra` overrides (head.* etc.) come
    last."""
    return [
        "head.kind=medusa",  # the smallest head; `extra` may name another
        f"target.name_or_path={model_dir}",
        "target.device=cpu",
        "target.num_threads=1",
        f"train.datasets=[{data}]",
        f"train.output_dir={out}",
        "train.max_steps=6",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.warmup_steps=2",
        "train.lr=0.01",
        "train.eval_every=3",
        "train.eval_fraction=0.2",
        "train.log_every=1",
        "train.autocast_dtype=float32",
        "train.save_every=3",
        *extra,
    ]


def small_run(model_dir: Path, data: Path, out: Path, *extra: str) -> RunConfig:
    """6 steps of 2 x 2 sequences, eval and checkpoint every 3, float32; `extra` overrides (head.*
    etc.)."""
    return load_config(RunConfig, None, small_run_args(model_dir, data, out, *extra))


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def loss_and_grads(module, loss_fn) -> tuple:
    """(loss, extra, grads) of one backward: `loss_fn()` gives a loss or (loss, extra); grads by
    parameter name, of the parameters that got one."""
    module.zero_grad()
    out = loss_fn()
    loss, extra = out if isinstance(out, tuple) else (out, None)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), extra, grads


def assert_same_training(reference: tuple, other: tuple) -> None:
    """Two `loss_and_grads` results agree in float64: the loss, every metric, every gradient."""
    import torch

    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = reference, other
    assert loss_a.dtype == torch.float64 and grads_a
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-10, atol=1e-12)
    assert (metrics_a or {}).keys() == (metrics_b or {}).keys()
    for k in metrics_a or {}:
        torch.testing.assert_close(
            metrics_b[k].double(), metrics_a[k].double(), rtol=1e-9, atol=1e-12, msg=k
        )
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-8, atol=1e-12, msg=k)


def recipe_parts(cfg: RunConfig, float64: bool = False) -> tuple:
    """train()'s named steps up to the model: (run, target, data, model), in float64 when asked."""
    from headway.train import loop

    run = loop.setup_run(cfg)
    target = loop.setup_target(run)
    data = loop.setup_data(run, target)
    model = loop.setup_model(run, target, data)
    if float64:
        target.model.double()
        model.heads.double()
    return run, target, data, model

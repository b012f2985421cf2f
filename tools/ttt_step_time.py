"""Time one EAGLE-3 training micro-step (objective forward + backward) on the default target's
shapes.

The target's features are random (a step's cost does not depend on their values), so this times the
head alone, as offline training (a feature cache) runs it. Batches are either synthetic (a prompt of
`--prompt` tokens then an answer of `--answer`) or read from a self-distilled dataset (`--data`).

    python tools/ttt_step_time.py --dtype float32 --threads 1 [--data DIR] [--steps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from headway.config import load_config
from headway.run_config import RunConfig
from headway.target.loading import load_target
from headway.train.data import Sample, collate, load_samples
from headway.train.losses import target_to_draft
from headway.train.objectives import Features
from headway.train.objectives.eagle3 import Eagle3Objective
from headway.train.setup_heads import build_heads


def batches(args: argparse.Namespace, target, vocab: int) -> list[list[Sample]]:
    if args.data:
        samples = [s for _, s in load_samples([args.data], target.fingerprint, args.max_length)[0]]
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(len(samples), generator=g).tolist()
        return [
            [samples[i] for i in order[k : k + args.batch]]
            for k in range(0, args.batch * args.repeats, args.batch)
        ]
    g = torch.Generator().manual_seed(0)
    n = args.prompt + args.answer

    def row() -> Sample:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        return Sample(ids, [0] * args.prompt + [1] * args.answer)

    return [[row() for _ in range(args.batch)] for _ in range(args.repeats)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="autocast dtype of the step",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=7, help="head.eagle3.ttt_steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-step")
    p.add_argument(
        "--prompt", type=int, default=128, help="synthetic batches: prompt tokens per row"
    )
    p.add_argument(
        "--answer", type=int, default=128, help="synthetic batches: answer tokens per row"
    )
    p.add_argument(
        "--data", default=None, help="a self-distilled dataset to draw real batches from"
    )
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=6, help="timed micro-steps (after one warm-up)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(
        RunConfig,
        "configs/eagle3_smollm2.yaml",
        [
            "target.device=cpu",
            f"target.num_threads={args.threads}",
            f"head.eagle3.ttt_steps={args.steps}",
            f"train.autocast_dtype={args.dtype}",
        ],
    )
    target = load_target(cfg.target)
    vocab = target.model.config.vocab_size
    data = batches(args, target, vocab)
    torch.manual_seed(0)
    heads = build_heads(cfg.head, cfg.train.init_from, target, [s for b in data for s in b]).train()
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))
    objective = Eagle3Objective(heads.cfg, seed=cfg.train.seed)
    L, h = target.model.config.num_hidden_layers, target.model.config.hidden_size
    layers = sorted(set(heads.cfg.feature_layers) | {L})
    compute = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    times, tokens = [], []
    for k, samples in enumerate([data[0]] + data):
        batch = collate(samples, target.tokenizer.pad_token_id or 0)
        B, T = batch["input_ids"].shape
        feats = Features(
            {i: torch.randn(B, T, h, dtype=torch.bfloat16) for i in layers}, model=target.model
        )
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32):
            loss, _ = objective(heads, batch, feats, t2d)
        loss.backward()
        heads.zero_grad(set_to_none=True)
        if k:
            times.append(time.perf_counter() - started)
            tokens.append(int(batch["attention_mask"].sum()))
    med = statistics.median(times)
    print(
        f"dtype={args.dtype} threads={args.threads} ttt_steps={args.steps} batch={args.batch} "
        f"mean tokens/micro-step={statistics.mean(tokens):.0f}: median {med * 1000:.0f} ms "
        f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}) over {len(times)} micro-steps"
    )


if __name__ == "__main__":
    main()

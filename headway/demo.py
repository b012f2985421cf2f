"""`headway demo`: the main job on the default target, end to end, from a fresh machine.

Today it runs the data stage: fetch the default target, let it write its own prompts (Magpie-style)
and answer them, and show what the resulting training data looks like. Training, export and
speculative decoding join this command as they land.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from headway.data_scripts.distill import DistillConfig, distill, load_distilled
from headway.data_scripts.magpie import MagpieConfig
from headway.run_config import RunConfig
from headway.heads.target import TargetConfig, load_tokenizer, resolve_target_dir


@dataclass
class DemoConfig:
    """The demo's budget: small enough for a few minutes on 2 CPU cores."""

    target: TargetConfig = field(default_factory=TargetConfig)
    magpie: MagpieConfig = field(default_factory=lambda: MagpieConfig(num_prompts=16))
    distill: DistillConfig = field(
        default_factory=lambda: DistillConfig(output_dir="outputs/demo/distill", max_new_tokens=128, chunk_size=16, batch_size=16)
    )
    # How many samples to print.
    show: int = 2


def run_demo(cfg: DemoConfig) -> Path:
    run = RunConfig(target=cfg.target, magpie=cfg.magpie, distill=cfg.distill)
    start = time.time()
    out = distill(run)
    ds, manifest = load_distilled(out)
    counts = manifest["counts"]
    tok = load_tokenizer(resolve_target_dir(cfg.target))
    print(f"\n== self-distilled dataset: {out}")
    print(f"   samples {counts['samples']}  generated tokens {counts['generated_tokens']}  skipped {counts['skipped']}")
    print(f"   engine {manifest['engine']}  {manifest['rank0_throughput_tok_s']} tok/s  ({time.time() - start:.0f} s in all)")
    for row in ds.select(range(min(cfg.show, len(ds)))):
        ids, mask = row["input_ids"], row["loss_mask"]
        first = mask.index(1) if 1 in mask else len(mask)
        prompt = tok.decode(ids[:first], skip_special_tokens=True).split("user\n", 1)[-1].rsplit("assistant", 1)[0].strip()
        answer = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True).strip()
        print(f"\n-- the target asked itself:\n{prompt}\n-- and answered ({sum(mask)} tokens, in the loss mask):\n{answer}")
    print("\nNext stages of the demo (train a head, export it, decode faster) arrive with the training issues.")
    return out


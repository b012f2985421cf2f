"""The training loop, readable top to bottom: frozen target features in, head loss out.

The target runs under no_grad in eval mode; its last hidden state feeds the heads. One optimizer
step = grad_accum micro-batches. Checkpoints carry everything needed to continue the same curve.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from headway.config import save_config
from headway.errors import HeadwayError
from headway.heads.checkpoint import save_head
from headway.heads.draft_layer import draft_layer_config, text_config
from headway.heads.eagle3 import Eagle3Head
from headway.heads.registry import LAYERED, build_head
from headway.heads.target import load_target
from headway.runtime import autocast_dtype
from headway.train.calibration import rank_accuracy
from headway.train.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from headway.run_config import RunConfig
from headway.data_scripts.cache_features import FeatureCache
from headway.train.data import Sample, batch_at, collate, load_samples, split_heldout, token_frequencies
from headway.train.logging import RunLogger
from headway.train.losses import distill_kl, target_to_draft
from headway.train.objectives import OBJECTIVES, Features

log = logging.getLogger("headway")


def add_lora(model: Any, lora: Any) -> Any:
    """Wrap the frozen target with trainable LoRA adapters (peft)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    try:
        return get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                    target_modules=list(lora.target_modules), bias="none"))
    except ValueError as e:
        raise HeadwayError(f"train.lora.target_modules {list(lora.target_modules)} do not fit this target: {e}") from None


def adapter_state(model: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def cosine_schedule(optimizer: Any, warmup: int, total: int, min_ratio: float) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_heads(cfg: RunConfig, target: Any, train_samples: list) -> Any:
    """A fresh head for the target; a reduced vocabulary is the most frequent tokens the target wrote."""
    kind = cfg.head.kind
    kind_cfg = cfg.head.kind_config()
    text = text_config(target.config)
    hidden, vocab, num_layers = int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers)
    if kind == "eagle3" and not kind_cfg.feature_layers:  # resolve the defaults now: they are saved with the head
        kind_cfg = replace(kind_cfg, feature_layers=Eagle3Head.feature_layers(kind_cfg, num_layers))
    d2t = None
    if kind == "eagle3" or getattr(kind_cfg, "lm_head", None) == "reduced":
        freq = token_frequencies(train_samples, vocab)
        size = min(kind_cfg.draft_vocab_size, vocab)
        d2t = torch.sort(torch.topk(freq, size).indices).values
        covered = float(freq[d2t].sum()) / max(1, int(freq.sum()))
        log.info("draft vocabulary: %d tokens cover %.1f%% of the target's training tokens", size, 100 * covered)
    layer_config = draft_layer_config(target.config) if kind in LAYERED else None
    heads = build_head(kind, kind_cfg, hidden, vocab, d2t=d2t, layer_config=layer_config)
    heads.init_from_target(target.model)
    heads.attach_target(target.model)
    return heads


def feature_layers(heads: Any, target: Any) -> list[int]:
    """The target hidden states a step needs: the head's own, plus the last one (the target's logits)."""
    num_layers = int(text_config(target.config).num_hidden_layers)
    return sorted(set(heads.feature_layers(heads.cfg, num_layers)) | {num_layers})


def _step_loss(cfg: RunConfig, target: Any, heads: Any, samples: list[Sample], t2d: Any, device: Any,
               adapt: bool = False, cache: Optional[FeatureCache] = None) -> tuple[torch.Tensor, dict]:
    """Head loss on one micro-batch. The target's features come from running it, or from the offline
    `cache`; with `adapt` (Medusa-2) the LoRA-adapted target runs with gradients and a distillation
    loss keeps it close to the frozen target."""
    batch = {k: v.to(device) for k, v in collate(samples, target.tokenizer.pad_token_id or 0).items()}
    ids, attn = batch["input_ids"], batch["attention_mask"]
    compute = autocast_dtype(cfg.train.autocast_dtype, device)
    autocast = torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32)
    if cache is not None:
        hidden, argmax = cache.batch([s.key for s in samples], ids.shape[1], device)
        feats = Features(hidden, model=target.model, argmax=argmax)
    else:
        with torch.set_grad_enabled(adapt), autocast:
            out = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        feats = Features({i: out.hidden_states[i] for i in feature_layers(heads, target)}, out.logits)
    with autocast:
        loss, metrics = OBJECTIVES[cfg.head.kind](cfg, heads, batch, feats, t2d)
    if adapt:
        with torch.no_grad(), target.model.disable_adapter(), autocast:
            frozen = target.model(input_ids=ids, attention_mask=attn).logits
        kl = distill_kl(out.logits, frozen, attn)
        metrics["loss/distill"] = float(kl.detach())
        loss = loss + cfg.train.lora.distill_weight * kl
    return loss, metrics


@torch.no_grad()
def evaluate(cfg: RunConfig, target: Any, heads: Any, held: list, t2d: Any, device: Any,
             cache: Optional[FeatureCache] = None) -> dict:
    """Per-head top-1 / top-5 accuracy and loss on the held-out split (token-weighted over batches)."""
    heads.eval()
    sums: dict[str, float] = {}
    batches = 0
    samples = held[: cfg.train.eval_max_samples]
    for start in range(0, len(samples), cfg.train.micro_batch_size):
        loss, metrics = _step_loss(cfg, target, heads, samples[start : start + cfg.train.micro_batch_size], t2d, device,
                                   cache=cache)
        metrics["loss"] = float(loss)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        batches += 1
    heads.train()
    return {f"eval/{k}": v / batches for k, v in sums.items()} if batches else {}


def train(cfg: RunConfig) -> Path:
    """Train a head on a frozen target; returns the directory of the exported native head."""
    tc = cfg.train
    out = Path(tc.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    random.seed(tc.seed)
    torch.manual_seed(tc.seed)
    target = load_target(cfg.target)
    device = target.device
    samples, _ = load_samples(tc.datasets, target.fingerprint, tc.max_length)
    train_set, held = split_heldout(samples, tc.eval_fraction)
    log.info("data: %d training sequences, %d held out", len(train_set), len(held))
    heads = build_heads(cfg, target, train_set).to(device)
    cache = None
    if tc.features_dir:
        cache = FeatureCache(tc.features_dir, target.fingerprint, feature_layers(heads, target),
                             {"datasets": list(tc.datasets), "max_length": tc.max_length})
        log.info("offline: the target's features come from %s", tc.features_dir)
    heads.train()
    t2d = target_to_draft(heads.d2t, heads.vocab_size, device)
    params = [p for p in heads.parameters() if p.requires_grad]
    groups = [{"params": params, "lr": tc.lr}]
    lora_params: list = []
    if tc.lora.enabled:
        target.model = add_lora(target.model, tc.lora)
        lora_params = [p for p in target.model.parameters() if p.requires_grad]
        groups.append({"params": lora_params, "lr": tc.lora.lr})
        log.info("Medusa-2: LoRA r=%d on %s (%d parameters), joining after %d heads-only steps",
                 tc.lora.r, ",".join(tc.lora.target_modules), sum(p.numel() for p in lora_params), tc.lora.heads_warmup_steps)
    optimizer = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, betas=tuple(tc.betas))
    scheduler = cosine_schedule(optimizer, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    step, consumed = 0, 0
    ckpt_root = out / "checkpoints"
    if tc.resume_from:
        path = latest_checkpoint(ckpt_root) if tc.resume_from == "auto" else Path(tc.resume_from)
        if path is None:
            log.info("resume_from=auto: no checkpoint in %s yet, starting fresh", ckpt_root)
        else:
            step, consumed = load_checkpoint(path, heads, optimizer, scheduler, target.model if tc.lora.enabled else None)
            log.info("resumed from %s at step %d", path, step)
    save_config(cfg, out)
    logger = RunLogger(out / "log.jsonl", cfg.logging, cfg, resume=step > 0)
    per_step = tc.micro_batch_size * tc.grad_accum
    log.info("effective batch: %d sequences (%d x %d accumulation)", per_step, tc.micro_batch_size, tc.grad_accum)
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step")
    started, tokens = time.time(), 0
    while step < tc.max_steps:
        optimizer.zero_grad(set_to_none=True)
        adapt = tc.lora.enabled and step >= tc.lora.heads_warmup_steps
        metrics_sum: dict[str, float] = {}
        loss_sum = 0.0
        for _ in range(tc.grad_accum):
            batch = batch_at(train_set, consumed, tc.micro_batch_size, tc.seed)
            consumed += tc.micro_batch_size
            tokens += sum(sum(s.loss_mask) for s in batch)
            loss, metrics = _step_loss(cfg, target, heads, batch, t2d, device, adapt, cache)
            (loss / tc.grad_accum).backward()
            loss_sum += float(loss.detach()) / tc.grad_accum
            for k, v in metrics.items():
                metrics_sum[k] = metrics_sum.get(k, 0.0) + v / tc.grad_accum
        if not math.isfinite(loss_sum):
            raise HeadwayError(f"loss became {loss_sum} at step {step}: lower train.lr or check the data")
        grad_norm = torch.nn.utils.clip_grad_norm_(params + lora_params, tc.grad_clip) if tc.grad_clip > 0 else torch.tensor(0.0)
        optimizer.step()
        scheduler.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        record = {"step": step, "loss": loss_sum, "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                  "tokens_per_s": tokens / max(1e-9, time.time() - started), **metrics_sum}
        if step % tc.log_every == 0 or step == 1:
            logger.log(record)
        if tc.eval_every and (step % tc.eval_every == 0 or step == tc.max_steps) and held:
            result = evaluate(cfg, target, heads, held, t2d, device, cache)
            logger.log({"step": step, **result})
            log.info("step %d eval: %s", step, " ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in result.items() if "top" in k))
        if (tc.save_every and step % tc.save_every == 0) or step == tc.max_steps:
            save_checkpoint(ckpt_root, step, heads, optimizer, scheduler, consumed, adapter_state(target.model, tc.lora.enabled))
    bar.close()
    logger.close()
    extra = {"trained_steps": step, "datasets": tc.datasets}
    if held and cfg.head.kind == "medusa":
        calib = held[: tc.eval_max_samples]
        extra["rank_accuracy"] = rank_accuracy(target, heads, calib, tc.micro_batch_size, t2d)
        log.info("measured per-rank accuracy of each head on %d held-out sequences (for the tree builder)", len(calib))
    write_lora = (lambda d: target.model.save_pretrained(str(d / "lora"))) if tc.lora.enabled else None
    if tc.lora.enabled:
        extra["adapted_target"] = "lora"
    head_dir = save_head(heads, out / "head", target.fingerprint, extra, write_extra=write_lora)
    log.info("trained head written to %s", head_dir)
    return head_dir

"""The train package's config sections: train, logging, and features (the offline feature cache
`headway cache-features` writes and training reads). A kind's own training settings are its
head.<kind> section's (heads/config.py), such as Medusa's loss, decay and Medusa-2's LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from headway.config import check_choice
from headway.errors import HeadwayError


@dataclass
class TrainConfig:
    # Self-distilled dataset directories (from `headway distill`); all must come from the configured
    # target.
    datasets: list[str] = field(default_factory=list)
    # Run directory: checkpoints/, head/ (the trained head), log.jsonl, config.yaml.
    output_dir: str = "outputs/train"
    # Optimiser steps; each sees micro_batch_size x grad_accum sequences.
    max_steps: int = 1000
    # Stop this process's training after this many seconds (checked every log_every steps, by rank
    # 0's clock), then evaluate, checkpoint and export as at max_steps; a rerun resumes towards
    # max_steps. 0 = no limit.
    max_seconds: float = 0.0
    micro_batch_size: int = 4
    # Length windows: the shuffled stream of sequences is cut into windows of this many, each sorted
    # by length, so a micro-batch's sequences are of similar length and pad little (a random batch
    # of 4 self-distilled gsm8k answers is ~35% padding, ~2% in windows of 128; every padded token
    # costs the target's forward and the head's). 0 or 1: off (plain shuffle).
    length_window: int = 128
    grad_accum: int = 1
    # Read the target's features from caches written by `headway cache-features` (together covering
    # train.datasets, same max_length) instead of running the target in every step; [] = online.
    # Not with Medusa-2 (head.medusa.lora).
    features_dir: list[str] = field(default_factory=list)
    # Duplicate answers dropped before the held-out split (the first of each group is kept): none,
    # exact (the same answer tokens) or near (estimated Jaccard similarity of their token 5-grams
    # >= dedup_threshold).
    dedup: str = "none"
    dedup_threshold: float = 0.8
    # Longer sequences are cut to this many tokens.
    max_length: int = 1024
    # Pack whole sequences into rows of train.pack_length tokens (each sequence attending to itself
    # only, its positions restarting at 0) instead of padding each micro-batch to its longest
    # sequence: a micro-batch is micro_batch_size rows, however many sequences fill them. Online
    # training only (no train.features_dir).
    packing: bool = False
    # Row length when packing, in tokens; 0 = train.max_length. At least max_length (no sequence is
    # split).
    pack_length: int = 0
    # AdamW with linear warm-up then cosine decay to min_lr_ratio x lr. 1e-3 beat 5e-4 for EAGLE-3
    # at an hour of CPU training (docs/benchmarks.md).
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    # Compute dtype of the head (and target) forward under autocast: auto (bfloat16 on GPUs and on
    # CPUs with native bf16 such as AVX512_BF16/AMX, float32 on AVX2-only CPUs that emulate it
    # slowly), bfloat16 or float32.
    autocast_dtype: str = "auto"
    # Fraction of samples held out for evaluation (chosen by sample id, stable across runs).
    eval_fraction: float = 0.02
    # Datasets evaluated instead of the held-out split (never trained on), e.g. the target's answers
    # to MT-bench; [] = the held-out split.
    eval_datasets: list[str] = field(default_factory=list)
    eval_every: int = 200
    # Evaluate on at most this many held-out sequences.
    eval_max_samples: int = 64
    # Checkpoint every N steps (and at the end); 0 = only at the end.
    save_every: int = 500
    # A checkpoint directory to continue from; "auto" = the newest whole one in
    # output_dir/checkpoints (so rerunning a killed command continues it); null = start over
    # (existing checkpoints are overwritten).
    resume_from: Optional[str] = "auto"
    # A head directory (same kind and target) whose weights and draft vocabulary a fresh run starts
    # from, for a run that goes on after its checkpoints are gone; its training-only settings
    # (EAGLE-3's ttt_steps, loss, ...) come from this config. Ignored when the run resumes from a
    # checkpoint.
    init_from: Optional[str] = None
    seed: int = 0
    log_every: int = 10
    # Several processes (launched by torchrun, or `headway train --nproc N`): ddp replicates the
    # head, fsdp (FSDP2) shards it and its optimizer state; none = one process. Each rank reads its
    # own share of every batch, so the effective batch is micro_batch_size x grad_accum x world
    # size. deepspeed = ZeRO (stage set by deepspeed_config), launched by `deepspeed` or torchrun.
    backend: str = "none"
    # train.backend=deepspeed: zero1, zero2 or zero3 (the configs in configs/deepspeed/), or the
    # path of a DeepSpeed JSON config; its "auto" fields (batch, accumulation, clipping, bf16) come
    # from train.*.
    deepspeed_config: str = "zero2"
    # Minutes a collective waits for the other ranks before the run fails (torch's default is 10):
    # rank 0 alone writes checkpoints and exports the head while the others wait in a barrier.
    dist_timeout_min: float = 30
    # train.backend=fsdp: shard the frozen target's decoder layers across ranks (FSDP2) instead of
    # keeping a whole copy on every rank; its embedding and lm_head stay whole (the heads share
    # them).
    shard_target: bool = False
    # Weights dtype of the frozen target in training: auto = bfloat16 on CUDA (its features as
    # engines serve them, at half the memory and twice the speed), target.dtype elsewhere; or
    # float32, bfloat16, float16.
    target_dtype: str = "auto"
    # Where the target's greedy next token comes from, for the kinds that need only it of the
    # target's full
    # distribution (EAGLE-3, DFlash; Medusa with CE reads none): logits = its full lm_head in every
    # step; data = the next token of data distilled at temperature 0, which is that argmax, so the
    # full lm_head ([tokens, vocabulary]) is skipped; auto = data on CUDA when every dataset is
    # greedy, logits elsewhere.
    target_argmax: str = "auto"
    # When a non-finite loss stops the run: step = read each step's loss before its update (nothing
    # of a bad step is applied; a host sync per step), lagged = read it one step later (no stall of
    # the GPU; the bad step's update is applied, never saved); auto = step on CPUs, lagged on CUDA.
    finite_check: str = "auto"
    # Peak FLOP/s of one device in TFLOP/s, for the logged MFU; 0 = the GPU's dense bf16 peak when
    # known (train/metrics.py), none logged on CPUs.
    peak_tflops: float = 0.0
    # Rows per chunk of the draft vocabulary loss (EAGLE-3): each chunk's logits, loss and gradients
    # are made and dropped at once, so no [rows, vocabulary] tensor is kept for backward; 0 = one
    # pass; -1 = auto (one pass on CPUs, 4096 on CUDA).
    loss_chunk: int = -1
    # Activation checkpointing of the target's decoder layers while Medusa-2 trains its LoRA
    # adapters (the adapted target runs with gradients through every layer): layers = each decoder
    # layer keeps only its [B, T, hidden] input for backward and runs again there (about a third
    # more target compute); none = every layer keeps all its activations; auto = layers on CUDA,
    # none on CPUs. The frozen target without adapters runs with no gradients and keeps nothing
    # either way.
    target_checkpointing: str = "auto"
    # The host's part of the next step (reading the stream, collating, the objective's index
    # tensors, pinning them) while the device runs this one: thread = on a background thread; none
    # = between steps; auto = thread on CUDA, none on CPUs (where a planning thread would take the
    # step's own cores).
    plan_ahead: str = "auto"
    # Attention of EAGLE-3's training-time test: structured (additive masks; its scores are kept for
    # backward, memory growing with the square of the length), flex (torch's flex attention with
    # block masks: output and log-sum-exp kept only; CUDA), recompute (the scores recomputed in
    # backward, in chunks of queries: memory flat in the length, any device, slower), auto = flex on
    # CUDA, structured elsewhere.
    ttt_attention: str = "auto"
    # Lengths flex attention is compiled for (ttt_attention=flex): the head's sequence length and
    # the count of kept positions are padded up to the smallest bucket that holds them (the padding
    # masked out), so each (bucket, bucket) shape compiles once, all before step 1, and a new shape
    # is an error, never a silent fallback to eager attention; multiples of 128 (flex's block),
    # ascending; [] = auto: powers of two from 256 up to the first one holding the longest row
    # (max_length, or pack_length when packing).
    flex_buckets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choice("train", "dedup", self.dedup, ["none", "exact", "near"])
        if self.max_seconds < 0:
            raise HeadwayError(
                f"train.max_seconds must be 0 (no limit) or positive, got {self.max_seconds}"
            )
        overlap = sorted(set(self.eval_datasets) & set(self.datasets))
        if overlap:
            raise HeadwayError(
                f"train.eval_datasets {overlap} are also train.datasets: evaluate on data the head "
                "never trains on, or leave train.eval_datasets=[] for a held-out split"
            )
        if not 0 < self.dedup_threshold <= 1:
            raise HeadwayError(
                f"train.dedup_threshold must be in (0, 1], got {self.dedup_threshold}"
            )
        check_choice(
            "train", "autocast_dtype", self.autocast_dtype, ["auto", "bfloat16", "float32"]
        )
        check_choice("train", "backend", self.backend, ["none", "ddp", "fsdp", "deepspeed"])
        check_choice(
            "train", "target_dtype", self.target_dtype, ["auto", "float32", "bfloat16", "float16"]
        )
        check_choice("train", "finite_check", self.finite_check, ["auto", "step", "lagged"])
        check_choice("train", "target_argmax", self.target_argmax, ["auto", "logits", "data"])
        check_choice(
            "train", "target_checkpointing", self.target_checkpointing, ["auto", "layers", "none"]
        )
        check_choice("train", "plan_ahead", self.plan_ahead, ["auto", "thread", "none"])
        check_choice(
            "train",
            "ttt_attention",
            self.ttt_attention,
            ["auto", "structured", "flex", "recompute"],
        )
        if self.pack_length < 0 or 0 < self.pack_length < self.max_length:
            raise HeadwayError(
                f"train.pack_length={self.pack_length} must be 0 (train.max_length) or at least "
                f"train.max_length={self.max_length}: a packed row holds whole sequences"
            )
        if self.packing and self.features_dir:
            raise HeadwayError(
                "train.packing runs the target on the packed rows: it needs online training; unset "
                "train.features_dir, or set train.packing=false"
            )
        if self.loss_chunk < -1:
            raise HeadwayError(
                f"train.loss_chunk must be -1 (auto), 0 (one pass) or a row count, got {self.loss_chunk}"
            )
        if self.peak_tflops < 0:
            raise HeadwayError(
                f"train.peak_tflops must be 0 (auto) or positive, got {self.peak_tflops}"
            )
        if self.shard_target and self.backend != "fsdp":
            raise HeadwayError(
                "train.shard_target shards the target with FSDP2: set train.backend=fsdp"
            )
        if any(b <= 0 or b % 128 for b in self.flex_buckets) or self.flex_buckets != sorted(
            set(self.flex_buckets)
        ):
            raise HeadwayError(
                f"train.flex_buckets must be ascending multiples of 128 (flex's block), got "
                f"{self.flex_buckets}"
            )
        if self.length_window < 0:
            raise HeadwayError(
                f"train.length_window must be 0 (off) or positive, got {self.length_window}"
            )
        if self.dist_timeout_min <= 0:
            raise HeadwayError(
                f"train.dist_timeout_min must be positive, got {self.dist_timeout_min}"
            )
        if self.micro_batch_size < 1 or self.grad_accum < 1 or self.max_steps < 1:
            raise HeadwayError(
                "train.micro_batch_size, train.grad_accum and train.max_steps must be >= 1"
            )
        if not 0 <= self.eval_fraction < 1:
            raise HeadwayError(f"train.eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclass
class LoggingConfig:
    # wandb project; null = no wandb. WANDB_MODE=offline works without a network.
    wandb_project: Optional[str] = None
    wandb_run_name: Optional[str] = None


@dataclass
class FeaturesConfig:
    # Where `headway cache-features` writes the shards; train.features_dir lists such directories.
    output_dir: str = "outputs/features"
    # Target hidden-state indices (HF output_hidden_states) to keep; empty = what head.kind reads,
    # plus the last one (the target's logits are recomputed from it). Cache (2, L//2, L-3, L) to
    # serve every kind.
    layers: list[int] = field(default_factory=list)
    # Storage dtype: bfloat16 halves the disk; float32 gives bit-identical losses to online
    # training.
    dtype: str = "bfloat16"
    # Sequences per shard (the unit of resumption) and per target forward.
    shard_size: int = 256
    batch_size: int = 8

    def __post_init__(self) -> None:
        check_choice("features", "dtype", self.dtype, ["bfloat16", "float16", "float32"])
        if self.shard_size < 1 or self.batch_size < 1:
            raise HeadwayError("features.shard_size and features.batch_size must be >= 1")

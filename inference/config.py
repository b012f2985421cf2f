"""The inference package's config sections: decoding (shared by `generate`, `bench` and `tune`), the bench's
and the tuner's own settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from headway.config import check_choice
from headway.errors import HeadwayError
from headway.inference.draft_hybrid import HybridConfig
from headway.inference.engine import ENGINES
from headway.inference.sampling import SamplingConfig

BASELINES = ("hf_generate", "hf_prompt_lookup")  # the peers `headway bench` can run
DRAFTERS = ("neural", "ngram", "hybrid")
# The methods a bench result names, and how tables and plots label them.
PLAIN, SPEC = "plain", "speculative"
LABELS = {
    PLAIN: "Headway plain",
    "hf_generate": "HF generate",
    "hf_prompt_lookup": "HF prompt lookup",
    SPEC: "Headway speculative",
    "headway_neural": "Headway neural tree",
    "headway_ngram": "Headway n-gram tree",
    "headway_hybrid": "Headway hybrid tree",
}


# A small static tree (8 nodes + root) for 4 Medusa heads: on a CPU, verifying many nodes costs more
# than it gains (the verify cost grows with the node count, docs/benchmarks.md), so the default stays small.
DEFAULT_MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


DRAFTER_DTYPES = ("auto", "target", "bfloat16", "float32")


@dataclass
class InferenceConfig:
    # Static trees (Medusa, DFlash): each node is a path of top-k indices, one per position ahead of the root;
    # null = the head kind's default (Medusa: DEFAULT_MEDUSA_TREE; DFlash: the chain of its whole block).
    tree: Optional[list[list[int]]] = None
    # > 0: build the best tree of this many nodes from the head's measured per-rank accuracy
    # (saved at the end of training), instead of `tree`.
    tree_nodes: int = 0
    # EAGLE-2 dynamic tree (EAGLE heads): drafter steps per tree, children per expanded node, and how
    # many draft nodes (root excluded) the target verifies per forward. Depth 3, not EAGLE-2's 5-6: on a CPU each
    # drafter step costs ~1/20 of a verification or more and the shipped head's nodes past depth 3 rarely make the 15
    # (docs/benchmarks.md); `headway tune` picks per machine.
    depth: int = 3
    top_k: int = 8
    total_tokens: int = 15
    max_new_tokens: int = 256
    # The target's forward: auto (static for llama, qwen2 and mistral targets with full attention, else hf),
    # static (a preallocated KV cache and Headway's own attention around the model's modules), hf (the
    # model's own forward and transformers cache), compiled (static, its decoder layers under torch.compile: faster
    # plain decoding in float32 after minutes of compiling on first use, docs/benchmarks.md; in bf16 only the
    # static engine is exact). Plain and speculative decoding use the same one.
    engine: str = "auto"
    # What proposes the draft tree: hybrid (the head's branches and prompt-lookup branches in one tree, its size
    # and split chosen each step from calibrated confidence and this machine's verify cost; see inference.hybrid),
    # neural (the head's tree alone, sized by the settings above), ngram (prompt lookup alone, no head needed).
    drafter: str = "hybrid"
    # The head's dtype while decoding (drafts steer only the speed, never the output): target (the target's dtype),
    # bfloat16, float32, or auto: bfloat16 for an EAGLE-3 head beside a float32 target in the stream format on CPUs
    # with AVX512-BF16 (its linears then read half the bytes, through the bf16 streaming kernel), else the target's.
    drafter_dtype: str = "auto"
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    # Use the tree `headway tune` chose for this head on this machine (tuned.json in the head directory) in place
    # of tree / tree_nodes / depth / top_k / total_tokens; setting one of those on the command line also turns it off.
    use_tuned: bool = True
    # Also decode plainly (same engine) and report the speedup and whether the outputs match.
    compare_plain: bool = True
    # System prompt for chat prompts; null = the chat template's default.
    system_prompt: Optional[str] = None
    # Temperature 0 (greedy, the default) or sampling; plain and speculative decoding use the same.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        check_choice("inference", "engine", self.engine, list(ENGINES))
        check_choice("inference", "drafter", self.drafter, list(DRAFTERS))
        check_choice("inference", "drafter_dtype", self.drafter_dtype, list(DRAFTER_DTYPES))


@dataclass
class BenchConfig:
    # Peers run beside Headway's plain and speculative decoding: hf_generate, hf_prompt_lookup; [] = none.
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    # Headway speculative decoding with other drafters too (neural, ngram, hybrid; same engine and budget settings),
    # besides inference.drafter: e.g. [neural, ngram] to compare a hybrid tree with each of its halves.
    drafters: list[str] = field(default_factory=list)
    # Hugging Face prompt lookup: draft tokens per step (prompt_lookup_num_tokens) and the longest n-gram matched.
    prompt_lookup_tokens: int = 10
    prompt_lookup_max_ngram: int = 2
    # User turns per prompt record (MT-bench has 2); 0 = all the record has.
    turns: int = 0
    # Only the first N prompts of each category (after prompts.limit); 0 = all.
    per_category: int = 0
    # Also draw a PNG (acceptance by depth; speedup by category and method) beside the JSON.
    plot: bool = True

    def __post_init__(self) -> None:
        for b in self.baselines:
            check_choice("bench", "baselines", b, list(BASELINES))
        for d in self.drafters:
            check_choice("bench", "drafters", d, list(DRAFTERS))
        if (
            self.turns < 0
            or self.per_category < 0
            or self.prompt_lookup_tokens < 1
            or self.prompt_lookup_max_ngram < 1
        ):
            raise HeadwayError("bench.turns and bench.per_category must be >= 0, bench.prompt_lookup_* >= 1")


@dataclass
class TuneConfig:
    # Calibration prompts (jsonl/json/parquet, first user turns); null = the prompts shipped with Headway.
    prompts: Optional[str] = None
    num_prompts: int = 8
    max_new_tokens: int = 128
    # Verified-token counts whose target forward time is measured (others are interpolated); [] = every count the
    # search scores (each tree size + the root). Small counts can cost more than larger ones on a CPU (matmul
    # kernels change with the row count), so measuring each is safer than interpolating.
    verify_sizes: list[int] = field(default_factory=list)
    repeats: int = 7
    # EAGLE-2 search space (every combination is scored; total_tokens larger than the expansion are skipped).
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    top_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    total_tokens: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 63])
    # Medusa search space: tree sizes (draft nodes), and how many ranked guesses per head are considered.
    medusa_nodes: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 63])
    medusa_top_k: int = 8
    # The drafters compared (neural: the best tree above; ngram; hybrid: that tree's neural branches with n-gram ones),
    # each replayed along the calibration answers with its own per-step choices.
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))
    # Decode the calibration prompts with the configured and the tuned tree beside plain decoding at the end.
    validate: bool = True

    def __post_init__(self) -> None:
        for name in ("verify_sizes", "depths", "top_ks", "total_tokens", "medusa_nodes"):
            values = getattr(self, name)
            if (not values and name != "verify_sizes") or (values and min(values) < 1):
                raise HeadwayError(f"tune.{name} must be a non-empty list of numbers >= 1 (got {values})")
        for d in self.drafters:
            check_choice("tune", "drafters", d, list(DRAFTERS))
        if not self.drafters:
            raise HeadwayError("tune.drafters must name at least one of " + ", ".join(DRAFTERS))
        if self.num_prompts < 1 or self.max_new_tokens < 2 or self.repeats < 1 or self.medusa_top_k < 1:
            raise HeadwayError(
                "tune.num_prompts, tune.repeats and tune.medusa_top_k must be >= 1, tune.max_new_tokens >= 2"
            )

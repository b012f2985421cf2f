"""The inference package's config sections: decoding (shared by `generate`, `bench` and `tune`),
sampling, the hybrid drafter, the bench's and the tuner's own settings.

Torch-free, like every config module: the command line checks a config before it loads torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from headway.config import check_choice
from headway.errors import HeadwayError

# The target's forward: see InferenceConfig.engine.
ENGINES = ("auto", "static", "compiled", "cuda", "hf")
# The CUDA backend's buckets where no decoder chose them (a runner made directly, as the tests do):
# plain decoding, EAGLE's 15 draft nodes + root, the hybrid's 32 + 1, and the GPU-sized trees (60 +
# 1).
CUDA_BUCKETS = (1, 16, 48, 64)
# The tree a target on a CUDA device decodes with where `headway tune` has chosen none for the
# machine (with inference.use_tuned=true): EAGLE-2's GPU tree (depth 6, top_k 10, the best 60
# nodes), and a hybrid tree of up to 60 nodes. A GPU verifies 61 rows in about the time of one (one
# inference.cuda_buckets bucket of 64), where a CPU's cost grows with every row.
GPU_TREE = {"depth": 6, "top_k": 10, "total_tokens": 60}
GPU_HYBRID_MAX_NODES = 60
# The inference keys a tree `headway tune` chose (tuned.json) replaces.
TREE_KEYS = ("tree", "tree_nodes", "depth", "top_k", "total_tokens", "drafter")
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
    "llamacpp": "llama.cpp plain",
    "llamacpp_head": "llama.cpp + head",
}


# The static tree inference.tree=null means for a static-tree kind without a default of its own
# (Medusa; DFlash's is the chain of its whole block): small (8 nodes + root, 4 positions deep),
# since on a CPU verifying many nodes costs more than it gains (the verify cost grows with the node
# count, docs/benchmarks.md).
DEFAULT_STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]

# The tree sizes `headway tune` scores (draft nodes, root excluded; tune.total_tokens and
# tune.static_nodes): each up to 6, then sparser; the largest, 63, verifies 64 tokens with its root.
# The verify-cost curves are measured at the same counts, as tokens (cost_model.CURVE_TOKENS).
TREE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 63)


DRAFTER_DTYPES = ("auto", "target", "bfloat16", "float32")


@dataclass
class SamplingConfig:
    # 0 = greedy decoding (exactly the target's argmax); > 0 samples from the target's distribution.
    temperature: float = 0.0
    # Keep only the k most likely tokens before sampling; 0 = all (applied after temperature).
    top_k: int = 0
    # Nucleus: keep the smallest set of tokens whose probability reaches top_p; 1.0 = all (after
    # top_k).
    top_p: float = 1.0
    # Seed of the sampler's random generator: with the same seed a run is reproducible.
    seed: int = 0
    # exact: tree rejection sampling, the target's own distribution. typical: Medusa's typical
    # acceptance, LOSSY (accepts any draft the target finds plausible enough; the output
    # distribution is not the target's).
    acceptance: str = "exact"
    # typical: accept a draft x when p(x) > min(typical_epsilon, typical_delta * exp(-entropy(p))).
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        check_choice("inference.sampling", "acceptance", self.acceptance, ["exact", "typical"])
        if self.temperature < 0:
            raise HeadwayError(
                f"inference.sampling.temperature={self.temperature} must be >= 0 (0 = greedy)"
            )
        if self.top_k < 0:
            raise HeadwayError(
                f"inference.sampling.top_k={self.top_k} must be >= 0 (0 = no top-k filter)"
            )
        if not 0 < self.top_p <= 1:
            raise HeadwayError(f"inference.sampling.top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class HybridConfig:
    # Prompt lookup: the longest and the shortest suffix n-gram matched in the prompt and the text
    # so far.
    max_ngram: int = 4
    min_ngram: int = 2
    # Tokens one matched continuation proposes, and how many distinct continuations (most recent
    # match first).
    max_tokens: int = 12
    branches: int = 2
    # The most draft nodes one verification may hold; each step verifies as many as pay for
    # themselves (maybe none).
    max_nodes: int = 32
    # Verify time of n tokens relative to one: < 0 = measured on this machine (the curve `headway
    # tune` saved, else measured once when the decoder loads); >= 0 = the model 1 + node_cost * (n -
    # 1) (e.g. 0 on a large GPU).
    node_cost: float = -1.0
    # Starting acceptance estimates (optimistic, so every kind of branch is tried) and their weight
    # in pseudo-counts; each verification then adds what the target accepted.
    ngram_prior: float = 0.7
    prior_weight: float = 2.0
    # How much an acceptance estimate remembers: each observation of an edge kind scales the weight
    # of the earlier ones (and of the prior) by this, so the estimates follow the text being written
    # (1.0: plain averages over everything decoded so far, however long ago).
    memory: float = 1.0
    # Whether the neural drafter runs (hybrid): its gain is the tokens/s the target gave on the
    # steps it ran on over what the n-gram tree alone would have given on them. It stops running
    # where the gain is below gain_floor (judged after gain_steps steps, each scaling the weight of
    # the earlier ones by gain_memory) and then runs on probes only, so the gain follows the text:
    # probe_every steps apart at first, twice as far apart after each probe that leaves the gain
    # below the floor, up to probe_max.
    gain_floor: float = 0.95
    gain_steps: int = 8
    gain_memory: float = 0.97
    probe_every: int = 4
    probe_max: int = 32
    # How many levels an EAGLE drafter expands (up to inference.depth): on every
    # depth_probe_every-th step it runs, it expands all of them and prices the tree each shallower
    # depth would have made on that step, with the drafting time measured for that depth; the other
    # steps expand to the depth whose trees promised the most tokens/s. 0: always inference.depth.
    depth_probe_every: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise HeadwayError(
                f"inference.hybrid needs 1 <= min_ngram <= max_ngram (got {self.min_ngram}, {self.max_ngram})"
            )
        if self.max_tokens < 1 or self.branches < 1 or self.max_nodes < 1:
            raise HeadwayError("inference.hybrid.max_tokens, branches and max_nodes must be >= 1")
        if not 0 < self.ngram_prior <= 1 or self.prior_weight <= 0:
            raise HeadwayError(
                "inference.hybrid.ngram_prior must be in (0, 1] and prior_weight > 0"
            )
        if not 0 < self.memory <= 1 or not 0 < self.gain_memory <= 1:
            raise HeadwayError(
                f"inference.hybrid.memory and gain_memory must be in (0, 1] (got {self.memory}, "
                f"{self.gain_memory})"
            )
        if (
            self.gain_floor < 0
            or self.gain_steps < 1
            or not 1 <= self.probe_every <= self.probe_max
        ):
            raise HeadwayError(
                "inference.hybrid: gain_floor must be >= 0, gain_steps >= 1 and 1 <= probe_every <= probe_max"
            )
        if self.depth_probe_every < 0:
            raise HeadwayError(
                f"inference.hybrid.depth_probe_every must be >= 0 (0: always inference.depth; got "
                f"{self.depth_probe_every})"
            )


@dataclass
class InferenceConfig:
    # Static trees (Medusa, DFlash): each node is a path of top-k indices, one per position ahead of
    # the root; null = the head kind's default (Medusa: DEFAULT_STATIC_TREE; DFlash: the chain of
    # its whole block).
    tree: Optional[list[list[int]]] = None
    # > 0: build the best tree of this many nodes from the head's measured per-rank accuracy
    # (saved at the end of training), instead of `tree`.
    tree_nodes: int = 0
    # EAGLE-2 dynamic tree (EAGLE heads): drafter steps per tree, children per expanded node, and
    # how many draft nodes (root excluded) the target verifies per forward. Depth 3, not EAGLE-2's
    # 5-6: on a CPU each drafter step costs ~1/20 of a verification or more and the shipped head's
    # nodes past depth 3 rarely make the 15 (docs/benchmarks.md); `headway tune` picks per machine.
    depth: int = 3
    top_k: int = 8
    total_tokens: int = 15
    max_new_tokens: int = 256
    # The target's forward: auto (for llama, qwen2 and mistral targets with full attention: cuda on
    # a CUDA device, static elsewhere; else hf), cuda (the static engine's CUDA backend: bucketed
    # steps over persistent buffers, CUDA graphs, greedy acceptance on the device; it runs on CPU
    # tensors too), static (a preallocated KV cache and Headway's own attention around the model's
    # modules), hf (the model's own forward and transformers cache), compiled (static, its decoder
    # layers under torch.compile: faster plain decoding in float32 after minutes of compiling on
    # first use, docs/benchmarks.md; in bf16 only the static engine is exact). Plain and speculative
    # decoding use the same one.
    engine: str = "auto"
    # The CUDA backend's row buckets (inference.engine=cuda): a step of n rows pads to the smallest
    # bucket of at least n, and each bucket is one CUDA graph. [] (exact): one bucket for every
    # step, plain decoding included, that the drafters' largest tree fits (`cuda_buckets`): a row's
    # bits then never depend on the other rows. Several (e.g. [1, 16, 48, 64]: cheaper plain steps)
    # are not exact in any dtype on CUDA.
    cuda_buckets: list[int] = field(default_factory=list)
    # Capture each bucket's step as a CUDA graph after two eager warm-up runs (false: every step
    # eager; a failed capture falls back to eager for its bucket either way).
    cuda_graphs: bool = True
    # What proposes the draft tree: hybrid (the head's branches and prompt-lookup branches in one
    # tree, its size and split chosen each step from calibrated confidence and this machine's verify
    # cost; see inference.hybrid), neural (the head's tree alone, sized by the settings above),
    # ngram (prompt lookup alone, no head needed).
    drafter: str = "hybrid"
    # The head's dtype while decoding (drafts steer only the speed, never the output): target (the
    # target's dtype), bfloat16, float32, or auto: bfloat16 for an EAGLE-3 head beside a float32
    # target in the stream format on CPUs with AVX512-BF16 (its linears then read half the bytes,
    # through the bf16 streaming kernel), else the target's.
    drafter_dtype: str = "auto"
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    # Use the tree `headway tune` chose for this head on this machine (tuned.json in the head
    # directory) in place of tree / tree_nodes / depth / top_k / total_tokens; setting one of those
    # on the command line also turns it off.
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
        if any(int(b) < 1 for b in self.cuda_buckets):
            raise HeadwayError(
                f"inference.cuda_buckets must be row counts >= 1, or [] for one exact bucket (got "
                f"{self.cuda_buckets}): e.g. [1, 16, 48, 64]"
            )


@dataclass
class BenchConfig:
    # Peers run beside Headway's plain and speculative decoding: hf_generate, hf_prompt_lookup; [] =
    # none.
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    # Headway speculative decoding with other drafters too (neural, ngram, hybrid; same engine and
    # budget settings), besides inference.drafter: e.g. [neural, ngram] to compare a hybrid tree
    # with each of its halves.
    drafters: list[str] = field(default_factory=list)
    # Hugging Face prompt lookup: draft tokens per step (prompt_lookup_num_tokens) and the longest
    # n-gram matched.
    prompt_lookup_tokens: int = 10
    prompt_lookup_max_ngram: int = 2
    # User turns per prompt record (MT-bench has 2); 0 = all the record has.
    turns: int = 0
    # Only the first N prompts of each category (after prompts.limit); 0 = all.
    per_category: int = 0
    # Also draw a PNG (acceptance by depth; speedup by category and method) beside the JSON.
    plot: bool = True
    # Prompt-length buckets results are also reported by (their lower edges, in prompt tokens,
    # ascending): long prompts are where drafts drift (summarisation, RAG, multi-turn chat).
    length_buckets: list[int] = field(default_factory=lambda: [0, 256, 1000, 2000, 3000])
    # llama.cpp beside Headway (inference/bench/llamacpp.py): its llama-server executable; null =
    # not run. With it, each prompt is also decoded by llama.cpp plainly and with the head.
    llamacpp_server: Optional[str] = None
    # The target as a GGUF file for llama-server (llama.cpp's convert_hf_to_gguf.py; docs/export.md).
    llamacpp_target: Optional[str] = None
    # The head as llama.cpp loads it (`headway export --format gguf`'s head.gguf); null = the bench's
    # head exported for it (EAGLE-3, DFlash; another kind runs llama.cpp plainly only, and says why).
    llamacpp_draft: Optional[str] = None
    # Draft tokens per llama.cpp step, drafted in full; 0 = the head's own (EAGLE-3's trained unroll,
    # DFlash's block's mask slots).
    llamacpp_draft_tokens: int = 0
    # Threads llama-server decodes with; 0 = target.num_threads, else torch's.
    llamacpp_threads: int = 0

    def __post_init__(self) -> None:
        if self.llamacpp_server and not self.llamacpp_target:
            raise HeadwayError(
                "bench.llamacpp_server needs bench.llamacpp_target: the target as a GGUF file "
                "(llama.cpp's convert_hf_to_gguf.py TARGET_DIR --outtype bf16; docs/export.md)"
            )
        if self.llamacpp_draft_tokens < 0 or self.llamacpp_threads < 0:
            raise HeadwayError(
                "bench.llamacpp_draft_tokens and bench.llamacpp_threads must be >= 0 (0: the "
                f"defaults), got {self.llamacpp_draft_tokens} and {self.llamacpp_threads}"
            )
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
            raise HeadwayError(
                "bench.turns and bench.per_category must be >= 0, bench.prompt_lookup_* >= 1"
            )
        if (
            not self.length_buckets
            or self.length_buckets != sorted(set(self.length_buckets))
            or self.length_buckets[0]
        ):
            raise HeadwayError(
                f"bench.length_buckets={self.length_buckets}: give "
                "ascending lower edges in prompt tokens, from 0"
            )


@dataclass
class TuneConfig:
    # Keys older configs (a run's saved config.yaml) may hold -> the keys they are read as;
    # load_config renames them before merging. Renamed in issue 54: the static-tree search serves
    # DFlash's block as well as Medusa's heads.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "medusa_nodes": "static_nodes",
        "medusa_top_k": "static_top_k",
    }

    # Calibration prompts (jsonl/json/parquet, first user turns); null = the prompts shipped with
    # Headway.
    prompts: Optional[str] = None
    num_prompts: int = 8
    max_new_tokens: int = 128
    # Verified-token counts whose target forward time is measured (others are interpolated); [] =
    # every count the search scores (each tree size + the root). Small counts can cost more than
    # larger ones on a CPU (matmul kernels change with the row count), so measuring each is safer
    # than interpolating.
    verify_sizes: list[int] = field(default_factory=list)
    # Timed runs of each verified-token count (after a warm-up); the fastest is kept, since
    # interference only adds time.
    repeats: int = 7
    # EAGLE-2 search space (every combination is scored; total_tokens larger than the expansion are
    # skipped).
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    top_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    total_tokens: list[int] = field(default_factory=lambda: list(TREE_SIZES))
    # Static-tree search space (Medusa's heads, DFlash's block slots): tree sizes (draft nodes), and
    # how many ranked guesses per position are considered.
    static_nodes: list[int] = field(default_factory=lambda: list(TREE_SIZES))
    static_top_k: int = 8
    # The drafters compared (neural: the best tree above; ngram; hybrid: that tree's neural branches
    # with n-gram ones), each replayed along the calibration answers with its own per-step choices.
    drafters: list[str] = field(default_factory=lambda: list(DRAFTERS))
    # Decode the calibration prompts with the configured and the tuned tree beside plain decoding at
    # the end.
    validate: bool = True

    def __post_init__(self) -> None:
        for name in ("verify_sizes", "depths", "top_ks", "total_tokens", "static_nodes"):
            values = getattr(self, name)
            if (not values and name != "verify_sizes") or (values and min(values) < 1):
                raise HeadwayError(
                    f"tune.{name} must be a non-empty list of numbers >= 1 (got {values})"
                )
        for d in self.drafters:
            check_choice("tune", "drafters", d, list(DRAFTERS))
        if not self.drafters:
            raise HeadwayError("tune.drafters must name at least one of " + ", ".join(DRAFTERS))
        if (
            self.num_prompts < 1
            or self.max_new_tokens < 2
            or self.repeats < 1
            or self.static_top_k < 1
        ):
            raise HeadwayError(
                "tune.num_prompts, tune.repeats and tune.static_top_k must be >= 1, tune.max_new_tokens >= 2"
            )


def cuda_buckets(ic: InferenceConfig) -> tuple[int, ...]:
    """The CUDA backend's row buckets for these settings: inference.cuda_buckets, or (empty) one
    bucket that every tree of the drafters this config can make fits (EAGLE's total_tokens, the
    hybrid's max_nodes, a static tree's nodes, at least 15), plus the root, rounded up to a multiple
    of 16 rows."""
    if ic.cuda_buckets:
        return tuple(int(b) for b in ic.cuda_buckets)
    static = len(ic.tree) if ic.tree is not None else len(DEFAULT_STATIC_TREE)
    nodes = max(ic.total_tokens, ic.hybrid.max_nodes, ic.tree_nodes, static, 15) + 1
    return (-(-nodes // 16) * 16,)

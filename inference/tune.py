"""`headway tune`: pick the draft tree that is fastest on this machine for this head.

The best tree is a trade: a larger tree accepts more tokens per step, but verifying it costs more,
and how much more depends on the hardware (on a 2-core CPU 8 tokens cost ~1.5x one token; on a GPU
the curve is nearly flat). Tune measures the two sides separately and multiplies them out:

- cost: the target's forward time against the number of verified tokens, over a cache of typical
  length, and the drafter's time for each tree setting, all on this machine with these threads;
- acceptance: the target's greedy answers to calibration prompts are decoded once, then the drafter
  is replayed along them, and at every position each candidate tree is checked against the tokens
  the target really wrote next. A tree's accepted length is exactly the number of its nodes whose
  whole path matches (greedy verification accepts that chain), so one replay scores every tree.
  Medusa: every node's empirical match rate gives the best tree of each size. EAGLE-2: the dynamic
  tree for (depth, top_k, total_tokens) is the top total_tokens candidates of the expansion of
  depth `depth` with `top_k`, so one expansion per top_k scores every depth and size.

Expected tokens/s = (1 + accepted per step) / (verify + draft + commit time per step); the best
setting is saved in the head directory (tuned.json, keyed by machine, threads and dtype) and used by
`generate` and `bench` on the same machine unless inference.use_tuned=false or the command line sets
a tree. Tune ends by decoding the prompts with the configured and the tuned tree, beside plain.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import statistics
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

from headway.config import check_choice
from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.heads.packed_linear import linear_weights
from headway.inference.config import DRAFTERS
from headway.inference.engine import depth_matters, engine_name, make_runner
from headway.inference.generate import alternate, features_at, pooled
from headway.inference.tree import build_tree
from headway.io import atomic_write_json, read_json

log = logging.getLogger("headway")

TUNED_FILENAME = "tuned.json"
TREE_KEYS = (
    "tree",
    "tree_nodes",
    "depth",
    "top_k",
    "total_tokens",
    "drafter",
)  # the inference keys a tuned setting replaces


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


def machine_key(model: Any, engine: str = "auto") -> dict:
    """What a tuned setting is only valid for: the device, the processor, the thread count, the dtype (and the
    linear weights' format, when packed) and the decoding engine."""
    p = next(model.parameters())
    if p.device.type == "cuda":
        name = torch.cuda.get_device_name(p.device)
    else:
        name = _cpu_name()
    key = {
        "device": p.device.type,
        "processor": name,
        "threads": torch.get_num_threads(),
        "dtype": str(p.dtype),
        "engine": engine_name(model, engine),
    }
    if linear_weights(model) != "native":
        key["linear_weights"] = linear_weights(model)
    return key


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------- cost on this machine


@torch.inference_mode()
def verify_cost(
    model: Any, sizes: list[int], prefix_len: int, repeats: int, engine: str = "auto", shape: str = "chain"
) -> dict[int, float]:
    """Median seconds of one verification step over n tree tokens after a cache of prefix_len tokens, for
    each n in sizes: the target forward (with hidden states) on the decoding engine, the greedy acceptance
    walk and the cache compaction, as speculative_generate does them. n = 1 is plain decoding's step. The tree is
    a chain (`shape` chain: the deepest) or the root's children (flat): only a row-exact engine's cost depends on
    which (`depth_matters`)."""
    from headway.inference.sampling import Sampler, SamplingConfig, acceptance_rule

    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    runner = make_runner(model, prefix_len + max(sizes) + 1, engine)
    runner.forward(torch.randint(vocab, (prefix_len,), generator=gen))
    greedy, rule = Sampler(SamplingConfig()), acceptance_rule(SamplingConfig())
    out: dict[int, float] = {}
    for n in sorted(set(sizes)):
        tree = build_tree([[0] * d for d in range(1, n)] if shape == "chain" else [[i] for i in range(n - 1)])
        ids = torch.randint(vocab, (n,), generator=gen)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            if n == 1:
                runner.forward(ids)[0][-1].argmax().item()
            else:
                logits, _ = runner.forward(ids, tree, hidden=True)
                path, _ = rule(tree, ids.tolist(), logits, greedy)
                runner.keep(n, path)
            _sync(device)
            times.append(time.perf_counter() - t0)
            runner.truncate(prefix_len)
        out[n] = statistics.median(times[1:])
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interpolate(costs: dict[int, float], n: int) -> float:
    """Linear interpolation of the measured cost curve (extrapolated from the last two points past the end)."""
    xs = sorted(costs)
    if n in costs:
        return costs[n]
    if n < xs[0]:
        return costs[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if a < n < b:
            return costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a)
    a, b = (xs[-2], xs[-1]) if len(xs) > 1 else (xs[-1], xs[-1])
    slope = (costs[b] - costs[a]) / (b - a) if b > a else 0.0
    return costs[b] + slope * (n - b)


# ---------------------------------------------------------------- acceptance along the target's own answers


@dataclass
class Replay:
    """A greedy answer and the target's features along it: what the drafter sees at each position."""

    prompt: list[int]
    answer: list[int]
    features: torch.Tensor  # [len(prompt) + len(answer) - 1, F]


@torch.inference_mode()
def replay_answers(decoder: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Replay]:
    """Greedy answers to the prompts, then one target forward over each whole sequence for its features."""
    model = decoder.target.model
    device = next(model.parameters()).device
    out = []
    for ids in tqdm(prompts, desc="tune: target answers", unit="prompt"):
        answer = decoder.generate_plain(ids, max_new_tokens).tokens
        seq = torch.tensor([ids + answer[:-1]], device=device)
        o = model(seq, output_hidden_states=True)
        out.append(
            Replay(ids, answer, features_at(o.hidden_states, decoder.drafter.feature_layers, slice(None)))
        )
    return out


def eagle_acceptance(
    drafter: Any, replays: list[Replay], depths: list[int], top_ks: list[int], sizes: list[int]
) -> dict[tuple[int, int, int], float]:
    """Mean accepted drafts per step for every (depth, top_k, total_tokens), from one expansion per top_k at
    the deepest depth at every answer position (see the module docstring)."""
    sums: dict[tuple[int, int, int], float] = {}
    steps = 0
    for r in tqdm(replays, desc="tune: drafter replay", unit="prompt"):
        for _, counts in eagle_accepted_along(drafter, r, depths, top_ks, sizes):
            steps += 1
            for key, c in counts.items():
                sums[key] = sums.get(key, 0.0) + c
    return {key: v / max(1, steps) for key, v in sums.items()}


def eagle_accepted_along(
    drafter: Any, r: Replay, depths: list[int], top_ks: list[int], sizes: list[int]
) -> Any:
    """For each answer position p (the root being answer[p]): p and the drafts greedy verification would
    accept there for every (depth, top_k, total_tokens) whose tree the expansion can fill."""
    dmax = max(depths)
    n_prompt = len(r.prompt)
    drafter.begin(r.prompt, r.answer[0], r.features[:n_prompt])
    for p in range(len(r.answer) - 1):
        want = r.answer[p + 1 :]
        counts: dict[tuple[int, int, int], int] = {}
        for k in top_ks:
            tokens, scores, parents, cdepths = drafter.candidates(dmax, k)
            target_ids = drafter.heads.to_target_ids(
                torch.tensor(tokens, device=drafter.param.device)
            ).tolist()
            chain = _matching_chain(target_ids, parents, cdepths, want)
            for d in depths:
                pool = [c for c in range(len(tokens)) if cdepths[c] <= d]
                rank = {c: i for i, c in enumerate(sorted(pool, key=lambda c: (-scores[c], cdepths[c], c)))}
                ranks = [rank[c] for c in chain if cdepths[c] <= d]
                for n in sizes:
                    if n <= len(pool):
                        counts[d, k, n] = sum(1 for x in ranks if x < n)
        yield p, counts
        drafter.accept([r.answer[p + 1]], r.features[n_prompt + p : n_prompt + p + 1])


def simulate(drafter: Any, replays: list[Replay], verify_seconds: Callable[[int, int], float]) -> dict:
    """Speculative decoding replayed along the target's greedy answers, without the target: each step the drafter
    drafts its tree, greedy verification would accept the longest path spelling the answer's next tokens, and the
    step costs verify_seconds(tree size, tree depth) plus the drafter's own measured time. Exact for greedy decoding, so any
    drafter (dynamic and hybrid trees too) is scored on what it would really do."""
    steps = accepted = 0
    seconds = 0.0
    for r in replays:
        n_prompt = len(r.prompt)
        drafter.begin(r.prompt, r.answer[0], r.features[:n_prompt])
        p = 0
        while p < len(r.answer) - 1:
            t0 = time.perf_counter()
            nodes, tree = drafter.draft(r.answer[p])
            ids, node, k = nodes.tolist(), 0, 0
            while p + 1 + k < len(r.answer):
                node = next((c for c in tree.children[node] if ids[c] == r.answer[p + 1 + k]), None)
                if node is None:
                    break
                k += 1
            k = min(k, len(r.answer) - 2 - p)  # the answer's last token is a bonus, never a draft
            drafter.accept(r.answer[p + 1 : p + k + 2], r.features[n_prompt + p : n_prompt + p + k + 1])
            seconds += time.perf_counter() - t0 + verify_seconds(tree.size, tree.max_depth)
            steps, accepted, p = steps + 1, accepted + k, p + k + 1
    tokens = steps + accepted
    return {"steps": steps, "tau": tokens / max(1, steps), "tok_s": tokens / max(1e-9, seconds)}


def _matching_chain(
    target_ids: list[int], parents: list[int], depths: list[int], want: list[int]
) -> list[int]:
    """The candidates whose whole path spells the target's next tokens: one per depth, until one is missing."""
    chain: list[int] = []
    parent = -1
    for d, token in enumerate(want, start=1):
        nxt = [
            c
            for c in range(len(target_ids))
            if parents[c] == parent and depths[c] == d and target_ids[c] == token
        ]
        if not nxt:
            break
        parent = nxt[0]
        chain.append(parent)
    return chain


def medusa_node_rates(heads: Any, replays: list[Replay], top_k: int) -> dict[tuple[int, ...], float]:
    """How often each Medusa tree node (a path of per-head ranks) matches the target's next tokens, per position."""
    counts: dict[tuple[int, ...], int] = {}
    steps = 0
    for r in replays:
        for _, path in medusa_matches_along(heads, r, top_k):
            steps += 1
            for d in range(1, len(path) + 1):
                counts[path[:d]] = counts.get(path[:d], 0) + 1
    return {path: c / max(1, steps) for path, c in counts.items()}


@torch.no_grad()
def medusa_matches_along(heads: Any, r: Replay, top_k: int) -> Any:
    """For each answer position p: p and the ranks of the target's next tokens among the heads' guesses, as far
    as they are among the top_k (every tree node that is a prefix of this path is accepted there)."""
    n_prompt = len(r.prompt)
    hidden = r.features[n_prompt - 1 :].to(next(heads.parameters()).dtype)  # the feature at each root
    logits = heads(hidden)  # [heads, positions, vocab]
    top = heads.to_target_ids(logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices).tolist()
    for p in range(len(r.answer) - 1):
        path: tuple[int, ...] = ()
        for d in range(len(top)):
            if p + 1 + d >= len(r.answer) or r.answer[p + 1 + d] not in top[d][p]:
                break
            path = path + (top[d][p].index(r.answer[p + 1 + d]),)
        yield p, path


def best_medusa_trees(
    rates: dict[tuple[int, ...], float], sizes: list[int]
) -> dict[int, tuple[list[list[int]], float]]:
    """For each size, the nodes with the highest match rates (a child never beats its parent, so they form a
    tree) and the expected accepted drafts per step, their summed rates."""
    ranked = sorted(rates, key=lambda p: (-rates[p], len(p), p))
    out = {}
    for n in sizes:
        chosen = ranked[:n]
        if len(chosen) == n:
            out[n] = ([list(p) for p in chosen], sum(rates[p] for p in chosen))
    return out


# ---------------------------------------------------------------- drafter cost


@torch.inference_mode()
def draft_cost(drafter: Any, replay: Replay, positions: int = 12) -> float:
    """Median seconds per step in the drafter: one draft() plus the accept() of the verified tokens."""
    n_prompt = len(replay.prompt)
    drafter.begin(replay.prompt, replay.answer[0], replay.features[:n_prompt])
    t_draft, t_accept = [], []
    for p in range(min(positions, len(replay.answer) - 1)):
        t0 = time.perf_counter()
        drafter.draft(replay.answer[p])
        t1 = time.perf_counter()
        drafter.accept([replay.answer[p + 1]], replay.features[n_prompt + p : n_prompt + p + 1])
        t_draft.append(t1 - t0)
        t_accept.append(time.perf_counter() - t1)
    return statistics.median(t_draft) + statistics.median(t_accept) if t_draft else 0.0


# ---------------------------------------------------------------- the search, the record, and its use


def calibration_prompts(decoder: Any, tc: TuneConfig) -> list[list[int]]:
    """First-turn prompt ids of the calibration prompts (the user's, or the set shipped with Headway)."""
    from headway.data_scripts.prompts import PromptConfig, load_conversations

    path = tc.prompts or str(Path(__file__).with_name("calibration_prompts.jsonl"))
    convs = load_conversations(PromptConfig(path=path, limit=tc.num_prompts))
    if not convs:
        raise HeadwayError(f"tune.prompts={path} has no prompts")
    return [decoder.fmt.first_turn(c.turns[0], c.system) for c in convs]


def search(
    decoder: Any, replays: list[Replay], cost: Callable[[int, int], float], tc: TuneConfig
) -> list[dict]:
    """Every candidate tree setting with its expected accepted drafts, step time and tokens/s, best first; cost(n,
    depth) is the verify time of n tokens in a tree that deep (`verify_costs`)."""
    from headway.inference.draft_eagle import EagleDrafter
    from headway.inference.draft_medusa import MedusaDrafter

    heads = decoder.heads
    num_layers = int(text_config(decoder.target.config).num_hidden_layers)
    out = []
    if heads.kind == "medusa":
        trees = best_medusa_trees(medusa_node_rates(heads, replays, tc.medusa_top_k), tc.medusa_nodes)
        for n, (choices, acc) in trees.items():
            drafter = MedusaDrafter(heads, build_tree(choices), num_layers)
            d_cost = draft_cost(drafter, replays[0])
            depth = max((len(c) for c in choices), default=0)
            out.append(_candidate({"tree": choices, "tree_nodes": 0}, n, acc, cost(n + 1, depth), d_cost))
    else:
        top_ks = [k for k in tc.top_ks if k <= heads.draft_vocab_size]
        acc = eagle_acceptance(decoder.drafter, replays, tc.depths, top_ks, tc.total_tokens)
        d_costs = {}
        for d in tc.depths:
            for k in top_ks:
                drafter = EagleDrafter(
                    heads, num_layers, d, k, max(n for (dd, kk, n) in acc if dd == d and kk == k)
                )
                d_costs[d, k] = draft_cost(drafter, replays[0])
        for (d, k, n), a in acc.items():
            out.append(
                _candidate(
                    {"depth": d, "top_k": k, "total_tokens": n}, n, a, cost(n + 1, min(d, n)), d_costs[d, k]
                )
            )
    return sorted(out, key=lambda c: -c["tok_s"])


def compare_drafters(
    decoder: Any,
    replays: list[Replay],
    cost: Callable[[int, int], float],
    neural_settings: dict,
    kinds: list[str],
) -> list[dict]:
    """Each drafter kind replayed along the calibration answers (simulate), best first: the neural tree with the
    chosen settings, n-gram branches alone, and both in one hybrid tree."""
    from headway.inference.api import make_drafter
    from headway.inference.draft_hybrid import HybridDrafter

    cfg = dataclasses.replace(
        decoder.cfg, inference=dataclasses.replace(decoder.cfg.inference, **neural_settings)
    )
    out = []
    for kind in kinds:
        neural = (
            make_drafter(decoder.heads, cfg, decoder.head_config, decoder.target.config)
            if kind != "ngram"
            else None
        )
        drafter = neural if kind == "neural" else HybridDrafter(neural, cfg.inference.hybrid, cost)
        out.append({"drafter": kind, **simulate(drafter, replays, cost)})
    return sorted(out, key=lambda d: -d["tok_s"])


def _candidate(settings: dict, nodes: int, accepted: float, verify_s: float, draft_s: float) -> dict:
    step = verify_s + draft_s
    return {
        "inference": settings,
        "draft_nodes": nodes,
        "expected_tau": 1 + accepted,
        "verify_ms": 1e3 * verify_s,
        "draft_ms": 1e3 * draft_s,
        "tok_s": (1 + accepted) / step,
    }


def read_tuned(head_dir: str | Path) -> list[dict]:
    path = Path(head_dir) / TUNED_FILENAME
    if not path.is_file():
        return []
    try:
        entries = read_json(path)["entries"]
    except (ValueError, KeyError, TypeError):
        raise HeadwayError(
            f"{path} is not a tuned-tree file: delete it and run `headway tune --head {head_dir}` again"
        ) from None
    return entries if isinstance(entries, list) else []


def save_tuned(head_dir: str | Path, entry: dict) -> Path:
    """Add this machine's entry to tuned.json (replacing an older one for the same machine)."""
    entries = [e for e in read_tuned(head_dir) if e.get("machine") != entry["machine"]] + [entry]
    path = Path(head_dir) / TUNED_FILENAME
    atomic_write_json(path, {"entries": entries})
    return path


def tuned_entry(head_dir: str | Path, model: Any, engine: str) -> Optional[dict]:
    """The head's tuned.json entry for this machine, thread count, dtype and engine, if any."""
    key = machine_key(model, engine)
    return next((e for e in read_tuned(head_dir) if e.get("machine") == key), None)


def tree_cost(chain: dict[int, float], flat: dict[int, float], n: int, depth: int) -> float:
    """The verify cost of n tokens in a tree `depth` levels deep, linear in depth between the flat tree (depth 1) and
    the chain (depth n - 1): on a row-exact engine each level is one more attention call per layer."""
    c = interpolate(chain, n)
    if n <= 2:
        return c
    f = min(interpolate(flat, n), c)  # a flat tree never costs more than a chain; a noisy measure can say so
    return f + (c - f) * (min(max(depth, 1), n - 1) - 1) / (n - 2)


def verify_costs(
    chain: dict[int, float], flat: Optional[dict[int, float]] = None
) -> Callable[[int, int], float]:
    """cost(n, depth) from the measured curves: the chain's alone where depth does not matter (flat None), else
    `tree_cost` between the two."""
    if flat is None:
        return lambda n, depth: interpolate(chain, n)
    return lambda n, depth: tree_cost(chain, flat, n, depth)


_measured_costs: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def verify_cost_curve(
    model: Any, engine: str, max_tokens: int, saved: Optional[dict] = None, shape: str = "chain"
) -> dict[int, float]:
    """Seconds to verify n tokens (a chain, or a flat tree) on this machine: the chain's curve `headway tune` saved
    (verify_ms of a tuned.json entry) when it reaches max_tokens, else measured now (a few seconds, once per model
    and engine)."""
    if shape == "chain" and saved and max(int(n) for n in saved) >= max_tokens:
        return {int(n): ms / 1e3 for n, ms in saved.items()}
    cache = _measured_costs.setdefault(model, {})
    key = (engine_name(model, engine), torch.get_num_threads(), max_tokens, shape)
    if key not in cache:
        sizes = sorted(
            {n for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64) if n < max_tokens} | {max_tokens}
        )
        log.info(
            "measuring the target's verification time over 1..%d tokens in a %s tree (once)",
            max_tokens,
            shape,
        )
        cache[key] = verify_cost(model, sizes, prefix_len=256, repeats=3, engine=engine, shape=shape)
    return cache[key]


def apply_tuned(cfg: Any, head_dir: str | Path, model: Any) -> Any:
    """cfg with its tree settings replaced by the head's tuned ones for this machine, if there are any (a copy;
    the caller's config is left as it was)."""
    if not cfg.inference.use_tuned:
        return cfg
    entries = read_tuned(head_dir)
    match = tuned_entry(head_dir, model, cfg.inference.engine)
    if match is None:
        if entries:
            log.info(
                "%s/%s has no tuned tree for this machine (%s); using the configured tree (run `headway tune`)",
                head_dir,
                TUNED_FILENAME,
                machine_key(model, cfg.inference.engine),
            )
        return cfg
    chosen = match["chosen"]["inference"]
    log.info(
        "using the tree `headway tune` chose for this machine: %s (inference.use_tuned=false for the configured one)",
        chosen,
    )
    return dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, **chosen))


def tune(head_dir: str | Path, cfg: Any) -> dict:
    """Measure, search, validate and save; returns the saved entry."""
    from headway.inference.api import SpeculativeDecoder

    tc = cfg.tune
    configured = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, use_tuned=False))
    as_configured = SpeculativeDecoder.load(head_dir, configured)
    # the search below scores the head's own trees
    decoder = (
        as_configured if configured.inference.drafter == "neural" else as_configured.with_drafter("neural")
    )
    model = decoder.target.model
    prompts = calibration_prompts(decoder, tc)
    replays = replay_answers(decoder, prompts, tc.max_new_tokens)
    prefix = int(statistics.median(len(p) for p in prompts) + tc.max_new_tokens // 2)
    sizes = tc.verify_sizes or [
        n + 1 for n in (tc.medusa_nodes if decoder.heads.kind == "medusa" else tc.total_tokens)
    ]
    log.info(
        "measuring the target's verification time over 1..%d tokens after a %d-token cache",
        max(sizes),
        prefix,
    )
    costs = verify_cost(model, sorted({1, *sizes}), prefix, tc.repeats, cfg.inference.engine)
    flat = None
    if depth_matters(model, cfg.inference.engine):
        log.info("and in a flat tree (this engine's cost depends on the tree's depth)")
        flat = verify_cost(model, sorted({1, *sizes}), prefix, tc.repeats, cfg.inference.engine, shape="flat")
    cost = verify_costs(costs, flat)
    candidates = search(decoder, replays, cost, tc)
    drafters = compare_drafters(decoder, replays, cost, candidates[0]["inference"], tc.drafters)
    best = {
        **candidates[0],
        "inference": {**candidates[0]["inference"], "drafter": drafters[0]["drafter"]},
        "replayed": drafters[0],
    }
    log.info(
        "replayed drafters (tokens/s): %s", ", ".join(f"{d['drafter']} {d['tok_s']:.1f}" for d in drafters)
    )
    entry = {
        "machine": machine_key(model, cfg.inference.engine),
        "date": time.strftime("%Y-%m-%d"),
        "chosen": best,
        "configured": {k: getattr(cfg.inference, k) for k in TREE_KEYS},
        "plain_tok_s_estimate": 1 / costs[1],
        "verify_ms": {str(n): 1e3 * s for n, s in sorted(costs.items())},
        "cache_prefix": prefix,
        **({"verify_flat_ms": {str(n): 1e3 * s for n, s in sorted(flat.items())}} if flat else {}),
        "calibration": {
            "prompts": tc.prompts or "shipped calibration_prompts.jsonl",
            "num_prompts": len(prompts),
            "answer_tokens": sum(len(r.answer) for r in replays),
            "max_new_tokens": tc.max_new_tokens,
        },
        "top_candidates": candidates[:15],
        "drafters": drafters,
    }
    if tc.validate:
        as_configured.saved_costs = entry["verify_ms"]
        entry["validation"] = validate(
            as_configured, configured, best["inference"], prompts, tc.max_new_tokens
        )
    path = save_tuned(head_dir, entry)
    log.info("saved %s", path)
    return entry


def validate(decoder: Any, cfg: Any, tuned: dict, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Plain decoding, the configured tree and the tuned tree on the prompts, in rotating order."""
    from headway.inference.api import SpeculativeDecoder

    tuned_cfg = dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, **tuned))
    tuned_decoder = SpeculativeDecoder(
        decoder.target, decoder.heads, tuned_cfg, decoder.head_config, decoder.saved_costs
    )
    runs = {
        "plain": lambda ids: decoder.generate_plain(ids, max_new_tokens),
        "configured": lambda ids: decoder.generate(ids, max_new_tokens),
        "tuned": lambda ids: tuned_decoder.generate(ids, max_new_tokens),
    }
    results: dict[str, list] = {n: [] for n in runs}
    for i, ids in enumerate(tqdm(prompts, desc="tune: validation", unit="prompt")):
        for n, r in alternate(runs, ids, i).items():
            results[n].append(r)
    out: dict = {
        n: {
            **pooled(rs),
            "matches_plain": sum(r.tokens == p.tokens for r, p in zip(rs, results["plain"])) / len(rs),
        }
        for n, rs in results.items()
    }
    out["tuned_over_configured"] = out["tuned"]["tok_s"] / out["configured"]["tok_s"]
    out["tuned_over_plain"] = out["tuned"]["tok_s"] / out["plain"]["tok_s"]
    return out

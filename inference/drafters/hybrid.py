"""Hybrid drafting: prompt-lookup branches and a neural drafter's branches in one tree, sized per
step.

Each step pools two kinds of candidates under the root: the neural drafter's (an EAGLE expansion or
a Medusa tree, each node with its draft probability given its parent) and n-gram continuations
copied from the prompt and the text so far (ngram.py). Candidates that propose the same token after
the same path merge into one node. A node's value is its estimated chance of being accepted: the
product, along its path, of each edge's acceptance estimate. Those estimates are online Beta
averages, updated after every verification from what the target really accepted: neural edges binned
by draft probability, n-gram edges by match length, position in the copy and whether the last step
accepted a copy. The N best nodes form the tree (a child never outranks its parent), and N is chosen
every step to maximise expected tokens per second, (1 + sum of values) / (verify time of N + 1
tokens in a tree that deep + drafting time): N = 0, a plain step, when nothing is likely enough to
pay for the larger verification. The neural drafter itself runs only where it has paid: after each
step it ran on, the tokens/s the target really gave is set against what the n-gram tree alone would
have given on the same step (the tree chosen without the neural candidates, walked along the tokens
the target wrote), separately for steps that continue an accepted copy and steps that do not. An
EAGLE drafter also expands only as many levels as pay for their drafting time: every few steps it
expands all of them, and the tree each shallower depth would have made on that step is priced with
that depth's measured drafting time. Verification, cache compaction and acceptance are the shared
code, so greedy output is exactly plain decoding's and sampling keeps the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from headway.inference.config import HybridConfig
from headway.inference.drafters.ngram import NgramIndex
from headway.inference.engines.tree import Tree, build_tree, tree_from_parents

NEURAL, NGRAM, BOTH = "neural", "ngram", "both"


class Rate:
    """An acceptance rate: a Beta estimate that starts at `prior` with `weight` pseudo-observations;
    with memory < 1 each new observation scales the weight of everything before it by `memory`."""

    def __init__(self, prior: float, weight: float, memory: float = 1.0):
        self.hits, self.seen, self.memory = prior * weight, weight, memory

    @property
    def value(self) -> float:
        return self.hits / self.seen

    def add(self, hit: bool) -> None:
        self.hits = self.hits * self.memory + hit
        self.seen = self.seen * self.memory + 1


class Calibration:
    """Acceptance estimates per edge kind, learnt from verifications."""

    BINS = 20  # neural edges: bins of draft probability

    def __init__(self, hc: HybridConfig):
        self.hc = hc
        self.rates: dict[tuple, Rate] = {}

    def _rate(self, key: tuple) -> Rate:
        if key not in self.rates:
            prior = (key[1] + 0.5) / self.BINS if key[0] == NEURAL else self.hc.ngram_prior
            self.rates[key] = Rate(prior, self.hc.prior_weight, self.hc.memory)
        return self.rates[key]

    @classmethod
    def neural_key(cls, prob: float) -> tuple:
        return (NEURAL, min(cls.BINS - 1, int(prob * cls.BINS)))

    @staticmethod
    def ngram_key(match: int, position: int, copying: bool) -> tuple:
        return (
            NGRAM,
            min(match, 4),
            min(position, 3),
            copying,
        )  # a copy that holds for 2 tokens tends to go on

    def estimate(self, keys: list[tuple]) -> float:
        return max(self._rate(k).value for k in keys)

    def observe(self, keys: list[tuple], hit: bool) -> None:
        for k in keys:
            self._rate(k).add(hit)


@dataclass
class Candidate:
    token: int
    parent: int  # candidate index, -1 = the root
    depth: int
    keys: list  # calibration keys of the sources that proposed it
    sources: set


class HybridDrafter:
    """Neural and n-gram branches in one tree (drafter=hybrid), or n-gram branches alone
    (drafter=ngram)."""

    drafts_on_device = False  # its n-gram branches are found on the host (generate.Drafter)

    def __init__(
        self,
        neural: Optional[Any],
        hc: HybridConfig,
        verify_cost: Callable[[int, int], float],
        timed: bool = True,
    ):
        """verify_cost(n, depth): the cost of verifying n tokens whose tree is `depth` levels deep
        below the root, in seconds when `timed` (the drafter's own time per step is then added to
        it), else in any unit (drafting counted as free)."""
        self.neural, self.hc, self.verify_cost, self.timed = neural, hc, verify_cost, timed
        self.feature_layers = neural.feature_layers if neural is not None else []
        self.max_nodes = hc.max_nodes + 1
        self.index = NgramIndex(hc.min_ngram, hc.max_ngram)
        self.calibration = Calibration(hc)
        self.copying = False  # the last verification accepted at least one n-gram token
        # moving average of the n-gram side's time per step (draft plus accept)
        self.draft_seconds = 0.0
        self.neural_seconds = 0.0  # moving average of the neural drafter's time when it runs
        # the depth an EAGLE drafter expands to, where drafting time counts and the drafter times
        # its levels
        self.depths: Optional[DepthChoice] = None
        if (
            timed
            and hc.depth_probe_every > 0
            and neural is not None
            and neural.expands_levels
            and neural.max_depth > 1
        ):
            self.depths = DepthChoice(neural.max_depth, hc.depth_probe_every)
        self.gate = NeuralGate(hc)
        self._step_seconds = 0.0
        self._pending: list[
            tuple[list[int], torch.Tensor]
        ] = []  # verified steps the neural drafter has not read
        self.root: Optional[int] = None
        # per node of the last tree (root: ""), for the loop's accounting
        self.node_sources: list[str] = []
        self._last: list[Candidate] = []  # per node of the last tree after the root
        self._children: list[list[int]] = []

    @property
    def max_depth(self) -> int:
        return max(self.hc.max_tokens, self.neural.max_depth if self.neural is not None else 0)

    def settings(self) -> dict:
        """The neural drafter's settings (its tree's), the drafter kind, and the n-gram and
        budget settings."""
        return {
            **(self.neural.settings() if self.neural is not None else {}),
            "drafter": "hybrid" if self.neural is not None else "ngram",
            "hybrid": {k: getattr(self.hc, k) for k in HybridConfig.__dataclass_fields__},
        }

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        self.index.reset(prompt)
        self.root, self.copying, self._pending = root, False, []
        self.gate.probe = None
        if self.neural is not None:
            self.neural.begin(prompt, root, features)

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.gate.score(tokens)
        self._learn(tokens[:-1])
        self.index.extend([self.root, *tokens[:-1]])
        self.root = tokens[-1]
        if (
            self.neural is not None
        ):  # the neural drafter reads them when it next drafts (one forward for many steps)
            self._pending.append((tokens, features))
        self._time(time.perf_counter() - t0, add=True)

    def draft(self, root: int) -> tuple[torch.Tensor, Tree]:
        t0 = time.perf_counter()
        self.root = root
        cands = self._ngram_candidates(root)
        context = self.copying
        if self.neural is not None and self.gate.runs(context):
            without = self._choose(cands)[0]
            depth, probe = self.depths.pick() if self.depths is not None else (None, False)
            t1 = time.perf_counter()
            proposed = self._neural_proposals(root, depth)
            spent = time.perf_counter() - t1
            # the n-gram candidates keep their indices
            ngram_cands, cands = cands, _merge(cands, proposed)
            if self.depths is not None:
                self.depths.timed(depth, spent, self.neural.level_seconds)
                neural_seconds = self.depths.seconds[depth]
            else:
                neural_seconds = self.neural_seconds = _average(self.neural_seconds, spent)
            chosen, rate = self._choose(cands, neural_seconds)
            # the trees the shallower depths would have made on this step, at their drafting time
            if probe:
                self.depths.score(
                    {
                        **{
                            d: self._choose(
                                _merge(ngram_cands, proposed, d), self.depths.seconds[d]
                            )[1]
                            for d in range(1, depth)
                        },
                        depth: rate,
                    }
                )
            self.gate.probe = Probe(
                context,
                {(cands[c].parent, cands[c].token): c for c in without},
                self._tree_cost(cands, without),
                self._tree_cost(cands, chosen) + (neural_seconds if self.timed else 0.0),
            )
            t0 += spent  # the n-gram side's time is kept apart
        else:
            chosen, _ = self._choose(cands)
        parents = [chosen.index(cands[c].parent) if cands[c].parent >= 0 else -1 for c in chosen]
        if chosen:
            tree, order = tree_from_parents(parents)
        else:
            tree, order = build_tree([]), []
        self._last = [cands[chosen[i]] for i in order]
        self._children = [list(ch) for ch in tree.children]
        self.node_sources = [""] + [_source(c.sources) for c in self._last]
        device = next(self.neural.heads.parameters()).device if self.neural is not None else "cpu"
        nodes = torch.tensor([root] + [c.token for c in self._last], device=device)
        self._time(time.perf_counter() - t0)
        return nodes, tree

    def _tree_cost(self, cands: list[Candidate], chosen: list[int]) -> float:
        """The modelled time of a step verifying these candidates (the n-gram side's drafting
        included)."""
        depth = max((cands[c].depth for c in chosen), default=0)
        return self.verify_cost(len(chosen) + 1, depth) + (
            self.draft_seconds if self.timed else 0.0
        )

    def _ngram_candidates(self, root: int) -> list[Candidate]:
        """The n-gram continuations as a trie (continuations sharing a prefix share its nodes)."""
        cands: list[Candidate] = []
        where: dict = {}
        for cont in self.index.lookup([root], self.hc.max_tokens, self.hc.branches):
            parent = -1
            for j, token in enumerate(cont.tokens, start=1):
                parent = _add(
                    cands,
                    where,
                    parent,
                    token,
                    Calibration.ngram_key(cont.match, j, self.copying),
                    NGRAM,
                )
        return cands

    def _neural_proposals(
        self, root: int, depth: Optional[int]
    ) -> tuple[list[int], list[float], list[int]]:
        """The neural drafter's most likely proposals (`_most_likely`), `depth` levels deep (None:
        its own depth), after it has read the steps it has not seen yet."""
        if self._pending:
            self.neural.accept(
                [t for toks, _ in self._pending for t in toks],
                torch.cat([f for _, f in self._pending]),
            )
            self._pending = []
        proposed = (
            self.neural.proposals(root) if depth is None else self.neural.proposals(root, depth)
        )
        return _most_likely(*proposed, self.hc.max_nodes)

    def _choose(
        self, cands: list[Candidate], extra_seconds: float = 0.0
    ) -> tuple[list[int], float]:
        """The candidates to verify, best first (the top N by value for the N with the best expected
        tokens/s), and that rate; extra_seconds is drafting time beyond the n-gram side's."""
        value = [0.0] * len(cands)
        for c, cand in enumerate(cands):  # parents come before their children
            value[c] = (
                value[cand.parent] if cand.parent >= 0 else 1.0
            ) * self.calibration.estimate(cand.keys)
        order = sorted(range(len(cands)), key=lambda c: (-value[c], cands[c].depth, c))[
            : self.hc.max_nodes
        ]
        drafting = self.draft_seconds + extra_seconds if self.timed else 0.0
        best_n, best_rate, expected, depth = 0, 1.0 / (self.verify_cost(1, 0) + drafting), 1.0, 0
        for n, c in enumerate(order, start=1):
            expected += value[c]
            depth = max(depth, cands[c].depth)
            rate = expected / (self.verify_cost(n + 1, depth) + drafting)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return order[:best_n], best_rate

    def _learn(self, accepted: list[int]) -> None:
        """Each tried edge (a child of the root or of an accepted node) was accepted or not: update
        its estimate."""
        if not self._children:
            return
        node, hits = 0, []
        for depth in range(len(accepted) + 1):
            want = accepted[depth] if depth < len(accepted) else None
            nxt = None
            for child in self._children[node]:
                cand = self._last[child - 1]
                hit = cand.token == want
                self.calibration.observe(cand.keys, hit)
                if hit:
                    nxt = child
                    hits.append(cand)
            if nxt is None:
                break
            node = nxt
        self.copying = any(NGRAM in c.sources for c in hits)

    def _time(self, seconds: float, add: bool = False) -> None:
        """The n-gram side's time per step (draft plus accept), as a moving average."""
        if add:
            self.draft_seconds = _average(self.draft_seconds or None, self._step_seconds + seconds)
        else:
            self._step_seconds = seconds


class DepthChoice:
    """How many levels the neural drafter expands: the depth whose trees promised the most tokens/s
    on the probe steps (steps that expand every level, where each shallower depth's tree is priced
    too, as a ratio to the full depth's), with each depth's drafting time measured on the steps that
    reach it."""

    def __init__(self, most: int, probe_every: int):
        self.most, self.probe_every = most, probe_every
        # per depth: moving averages of its promised tokens/s over the full depth's, and of its
        # drafting seconds
        self.ratio: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self.best, self.since = most, 0

    def pick(self) -> tuple[int, bool]:
        """The depth to expand this step, and whether it is a probe (every level, the shallower
        ones priced)."""
        self.since += 1
        if not self.ratio or self.since >= self.probe_every:
            self.since = 0
            return self.most, True
        return self.best, False

    def timed(self, depth: int, seconds: float, level_seconds: list[float]) -> None:
        """A step expanded `depth` levels in `seconds` (the drafter's reading of accepted steps
        included); the drafter's level_seconds split its expansion, so each depth up to it is timed
        too."""
        fixed = seconds - level_seconds[depth - 1]
        for d in range(1, depth + 1):
            self.seconds[d] = _average(self.seconds.get(d), fixed + level_seconds[d - 1])

    def score(self, rates: dict[int, float]) -> None:
        """A probe's promised tokens/s per depth (the full depth's included). Probes are few, so
        each weighs 0.3: the first ones, led by the acceptance estimates' priors, fade fast."""
        for d, rate in rates.items():
            self.ratio[d] = _average(self.ratio.get(d), rate / rates[self.most], 0.3)
        self.best = max(self.ratio, key=lambda d: (self.ratio[d], -d))


class NeuralGate:
    """Whether the hybrid runs its neural drafter this step. Per context (continuing an accepted
    copy or not) it keeps the realized gain of the steps the drafter ran on: the tokens/s the target
    gave against what the n-gram tree alone would have given on the same step. It runs the drafter
    while that gain holds, and otherwise probes at doubling intervals, so the estimate follows the
    text."""

    def __init__(self, hc: HybridConfig):
        self.hc = hc
        self.gains = {
            False: Gain(hc.gain_steps, hc.gain_memory),
            True: Gain(hc.gain_steps, hc.gain_memory),
        }
        self.skipped = {False: 0, True: 0}  # steps since the neural drafter last ran, per context
        # steps between probes, per context
        self.interval = {False: hc.probe_every, True: hc.probe_every}
        self.probe: Optional[Probe] = None  # the last step's, when the neural drafter ran on it

    def runs(self, context: bool) -> bool:
        """Whether to run the neural drafter on this step (and count the step)."""
        self.skipped[context] += 1
        gain = self.gains[context].value
        if gain is None or gain >= self.hc.gain_floor:
            self.skipped[context], self.interval[context] = 0, self.hc.probe_every
            return True
        if self.skipped[context] >= self.interval[context]:
            self.skipped[context] = 0
            self.interval[context] = min(2 * self.interval[context], self.hc.probe_max)
            return True
        return False

    def score(self, tokens: list[int]) -> None:
        """Set the last probed step against the n-gram tree alone on the same step: that tree would
        have accepted its longest path along the tokens the target wrote (at least; they end at the
        bonus)."""
        probe, self.probe = self.probe, None
        if probe is None:
            return
        node, alone = -1, 0
        for token in tokens:
            node = probe.ngram_tree.get((node, token), -2)
            if node == -2:
                break
            alone += 1
        self.gains[probe.context].add(len(tokens), probe.seconds, alone + 1, probe.ngram_seconds)
        if len(tokens) / probe.seconds >= self.hc.gain_floor * (alone + 1) / probe.ngram_seconds:
            self.interval[probe.context] = self.hc.probe_every  # it paid this time: look again soon


@dataclass
class Probe:
    """A step the neural drafter ran on: what to score it against once the target has verified
    it."""

    context: bool  # whether the step continued an accepted copy
    ngram_tree: (
        # (parent candidate or -1, token) -> candidate, for the tree chosen without the neural side
        dict
    )
    ngram_seconds: float  # that tree's modelled step time
    seconds: float  # the chosen tree's modelled step time plus the neural drafter's


class Gain:
    """Tokens/s with the neural drafter over tokens/s of the n-gram tree alone, on the steps it ran
    on: ratios of sums in which each step scales the earlier ones by `memory`; None until `steps`
        steps are in."""

    def __init__(self, steps: int, memory: float) -> None:
        self.sums, self.steps, self.need, self.memory = [0.0, 0.0, 0.0, 0.0], 0, steps, memory

    @property
    def value(self) -> Optional[float]:
        if self.steps < self.need:
            return None
        tokens, seconds, alone_tokens, alone_seconds = self.sums
        return (tokens / seconds) / (alone_tokens / alone_seconds)

    def add(self, tokens: float, seconds: float, alone_tokens: float, alone_seconds: float) -> None:
        self.sums = [
            self.memory * s + x
            for s, x in zip(self.sums, (tokens, seconds, alone_tokens, alone_seconds))
        ]
        self.steps += 1


def _average(mean: Optional[float], x: float, weight: float = 0.1) -> float:
    """An exponential moving average (`weight` on the new value); None starts it."""
    return x if not mean else (1.0 - weight) * mean + weight * x


def _add(
    cands: list[Candidate], where: dict, parent: int, token: int, key: tuple, source: str
) -> int:
    """The candidate for `token` after `parent` (made if new), with this source's calibration key
    added; `where` maps (parent, token) to its candidate."""
    c = where.get((parent, token))
    if c is None:
        c = where[parent, token] = len(cands)
        cands.append(
            Candidate(token, parent, 1 if parent < 0 else cands[parent].depth + 1, [], set())
        )
    if key not in cands[c].keys:
        cands[c].keys.append(key)
    cands[c].sources.add(source)
    return c


def _merge(
    cands: list[Candidate],
    proposed: tuple[list[int], list[float], list[int]],
    depth: Optional[int] = None,
) -> list[Candidate]:
    """The trie with the neural proposals (ids, probs, parents; parents first) merged in, those at
    most `depth` levels deep (None: all): a token proposed after the same path as a candidate joins
    its node. `cands` is left as it was (a joined node is a new Candidate), so one trie can take
    several merges."""
    cands = list(cands)
    where = {(c.parent, c.token): i for i, c in enumerate(cands)}
    placed: list[int] = []
    levels: list[int] = []
    for token, prob, p in zip(*proposed):
        levels.append(levels[p] + 1 if p >= 0 else 1)
        placed.append(-1)
        if depth is not None and levels[-1] > depth:
            continue  # its descendants are deeper still
        parent, key = placed[p] if p >= 0 else -1, Calibration.neural_key(prob)
        c = where.get((parent, token))
        if c is None:
            c = where[parent, token] = len(cands)
            cands.append(
                Candidate(
                    token, parent, 1 if parent < 0 else cands[parent].depth + 1, [key], {NEURAL}
                )
            )
        else:
            old = cands[c]
            keys = old.keys if key in old.keys else old.keys + [key]
            cands[c] = Candidate(old.token, old.parent, old.depth, keys, old.sources | {NEURAL})
        placed[-1] = c
    return cands


def _most_likely(
    ids: list[int], probs: list[float], parents: list[int], count: int
) -> tuple[list[int], list[float], list[int]]:
    """The `count` proposals most likely as paths (the product of the draft probabilities from the
    root; parents come first, ties to the shallower), in their order, with parents renumbered: a
    verification holds at most `count` nodes, and the drafter expands several times that many, which
    would only cost the choice time."""
    if len(ids) <= count:
        return ids, probs, parents
    path = [0.0] * len(ids)
    depth = [0] * len(ids)
    for c, (prob, p) in enumerate(zip(probs, parents)):
        # never above its parent's, whatever the rounding of prob
        path[c] = min(prob, 1.0) * (path[p] if p >= 0 else 1.0)
        depth[c] = depth[p] + 1 if p >= 0 else 1
    keep = sorted(sorted(range(len(ids)), key=lambda c: (-path[c], depth[c], c))[:count])
    index = {c: i for i, c in enumerate(keep)}
    return (
        [ids[c] for c in keep],
        [probs[c] for c in keep],
        [index[parents[c]] if parents[c] >= 0 else -1 for c in keep],
    )


def _source(sources: set) -> str:
    return BOTH if len(sources) > 1 else next(iter(sources))

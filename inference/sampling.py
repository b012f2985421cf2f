"""Sampling at temperature > 0: one target distribution for plain and speculative decoding, and the
tree acceptance rules that decide which drafted tokens a verification keeps.

`exact` (the default) is tree rejection sampling for deterministic drafts (a drafter's top-k, a
static Medusa tree, an n-gram): at a node the target's distribution p is the residual; the children
are tried in order, child x is accepted with probability p(x), and a rejected x has its mass removed
from the residual, which is renormalised; when every child fails, the next token is sampled from the
residual. Token x ends up chosen with probability exactly p(x) (p(x1), then (1 - p(x1)) * p(x2) / (1
- p(x1)), ...), so the output has the target's own distribution whatever the drafter guessed.
  `typical` is
Medusa's typical acceptance: faster, and lossy (the output is not the target's distribution).
"""

from __future__ import annotations

import torch

from headway.inference.config import SamplingConfig
from headway.inference.engines.distribution import target_distribution
from headway.inference.engines.static.row_select import first_max
from headway.inference.engines.tree import Tree


class Sampler:
    """Draws the random numbers of one generation from its own seeded generator (on the CPU, so a
    seed gives the same run on any device)."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))

    def next_token(self, logits: torch.Tensor) -> int:
        """A token from the target's distribution after `logits` (plain decoding, and the first
        token)."""
        if self.cfg.greedy:
            return greedy_token(logits)
        return self.sample(target_distribution(logits, self.cfg))


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the first largest of logits [V]: argmax's token (row_select.first_max)."""
    return int(first_max(logits))


def accept_greedy(
    tree: Tree, node_ids: list[int], logits: torch.Tensor, sampler: Sampler
) -> tuple[list[int], int]:
    """The longest path whose every token is the target's argmax; the next token is the argmax after
    it."""
    path, cur = [0], 0
    # reads only the rows on the walked path (the static engine computes logits as they are read)
    while True:
        choice = greedy_token(logits[cur])
        nxt = next((c for c in tree.children[cur] if node_ids[c] == choice), None)
        if nxt is None:
            return path, choice
        path.append(nxt)
        cur = nxt


def accept_exact(
    tree: Tree, node_ids: list[int], logits: torch.Tensor, sampler: Sampler
) -> tuple[list[int], int]:
    """Tree rejection sampling for deterministic drafts (see the module docstring): lossless."""
    path, cur = [0], 0
    while True:
        residual = target_distribution(logits[cur], sampler.cfg).cpu()
        accepted = None
        for child in tree.children[cur]:
            x = node_ids[child]
            if sampler.uniform() < float(residual[x]):
                accepted = child
                break
            residual[x] = 0.0
            residual /= residual.sum()
        if accepted is None:
            return path, sampler.sample(residual)
        path.append(accepted)
        cur = accepted


def accept_typical(
    tree: Tree, node_ids: list[int], logits: torch.Tensor, sampler: Sampler
) -> tuple[list[int], int]:
    """Medusa's typical acceptance (LOSSY): follow the first child the target finds plausible
    enough."""
    cfg = sampler.cfg
    path, cur = [0], 0
    while True:
        p = target_distribution(logits[cur], cfg).cpu()
        entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
        threshold = min(
            cfg.typical_epsilon, cfg.typical_delta * float(torch.exp(torch.tensor(-entropy)))
        )
        nxt = next((c for c in tree.children[cur] if float(p[node_ids[c]]) > threshold), None)
        if nxt is None:
            return path, sampler.sample(p)
        path.append(nxt)
        cur = nxt


def acceptance_rule(cfg: SamplingConfig):
    """The rule a verification uses: greedy at temperature 0, else exact (or the lossy typical)."""
    if cfg.greedy:
        return accept_greedy
    return accept_typical if cfg.acceptance == "typical" else accept_exact

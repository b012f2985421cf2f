"""EAGLE drafting with an EAGLE-2 dynamic tree, for EAGLE-1 and EAGLE-3 heads.

The drafter keeps its own KV cache of committed positions: position t holds (target feature at t,
token t+1). After each verification it reads the accepted positions with the target's real
features. To draft, it expands the tree `depth - 1` times: at each depth the `top_k` most likely
nodes so far (by the product of draft probabilities along their path) run through the drafter at
once, under a mask that lets each see the committed prefix and its own ancestors, and each gets
`top_k` children. The `total_tokens` best nodes overall become the tree the target verifies; the
cache entries of the expansions are dropped again, so the cache always matches the accepted text.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch

from headway.errors import HeadwayError
from headway.heads.draft_layer import drafter_mask
from headway.inference.drafters.eagle_device import EagleExpansion
from headway.inference.engines.hf import truncate_cache
from headway.inference.engines.options import EngineOptions
from headway.inference.engines.static.row_select import top_logprobs
from headway.inference.engines.static.runner import StaticLayerCache
from headway.inference.engines.tree import Tree, build_tree


class EagleDrafter:
    """EAGLE-2's dynamic tree: the drafter layer expanded `depth` steps with `top_k` children per
    node, the `total_tokens` most likely candidates verified."""

    drafts_on_device = True  # draft_tensors: the device expansion (generate.Drafter)
    node_sources = None
    # its tree grows level by level, each level timed (level_seconds): the hybrid
    expands_levels = True
    # chooses its depth

    @classmethod
    def from_config(
        cls,
        heads: Any,
        ic: Any,
        head_config: dict,
        num_target_layers: int,
        options: Optional[EngineOptions] = None,
    ) -> "EagleDrafter":
        """The drafter the inference section asks for (`ic`: InferenceConfig), its layer run with
        the static engine's `options` (default: EngineOptions()); the head's config is not
        needed."""
        return cls(
            heads,
            num_target_layers,
            ic.depth,
            ic.top_k,
            ic.total_tokens,
            static=ic.engine != "hf",
            options=options,
        )

    def __init__(
        self,
        heads: Any,
        num_target_layers: int,
        depth: int,
        top_k: int,
        total_tokens: int,
        static: bool = True,
        options: Optional[EngineOptions] = None,
    ):
        """static: keep the drafter layer's keys and values in a preallocated buffer (where its
        family allows) rather than a transformers DynamicCache; options: the engine settings
        drafting follows (target.layer_loop, target.fused_ops; EngineOptions, default: the
        defaults)."""
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise HeadwayError(
                "EAGLE tree settings need depth, top_k and total_tokens "
                f">= 1 (got {depth}, {top_k}, {total_tokens})"
            )
        if top_k > heads.draft_vocab_size:
            raise HeadwayError(
                f"inference.top_k={top_k} exceeds the head's draft vocabulary ({heads.draft_vocab_size})"
            )
        self.heads = heads
        self.static = static
        self.options = options or EngineOptions()
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.max_nodes = total_tokens + 1
        self.feature_layers = heads.feature_layers(heads.cfg, num_target_layers)
        self.cache: Any = None
        self.committed = 0
        # drafter output at the last committed position [h]
        self.last_out: torch.Tensor | None = None
        self.pending: list[int] = []  # tokens whose drafter positions are not in the cache yet
        # seconds from the start of the last expansion to the end of each of its levels (the hybrid
        # prices depth with them)
        self.level_seconds: list[float] = []
        # the device expansion (draft_tensors) over this drafter's reserved cache, kept across
        # sequences (on CUDA its graph), and the slots to reserve for it (`reserve`; 0: sized at
        # first use)
        self.expansion: Optional[EagleExpansion] = None
        self.reserved, self.graphs = 0, None

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def param(self) -> torch.Tensor:
        """A parameter of the head: its device and dtype now (the head may move after the drafter is
        made)."""
        return next(self.heads.parameters())

    def settings(self) -> dict:
        return {
            "drafter": "neural",
            "kind": self.heads.kind,
            "depth": self.depth,
            "top_k": self.top_k,
            "total_tokens": self.total_tokens,
        }

    def _new_cache(self) -> Any:
        """A static cache where the drafter's layer is of a family the static engine runs,
        else transformers'."""
        decoder = self.heads.decoder
        if self.static and StaticLayerCache.supported(decoder):
            opts = self.options
            return StaticLayerCache(decoder, loop=opts.layer_loop, fused=opts.fused_ops)
        from transformers import DynamicCache

        return DynamicCache(config=decoder.config)

    @torch.no_grad()
    def _commit(self, tokens: list[int], features: torch.Tensor) -> None:
        """Drafter positions committed..committed+n-1 from the target's real features and the next
        tokens."""
        n = len(tokens)
        dev = self.param.device
        if self.expansion is not None and not self._fits(self.committed + n):
            # past the reserved cache: let it grow, and make a larger expansion when next asked
            self.expansion, self.cache.fixed = None, False
        hidden = self.heads.project(features.to(dev).unsqueeze(0))
        pos = torch.arange(self.committed, self.committed + n, device=dev).unsqueeze(0)
        allowed = torch.ones(1, n, self.committed + n, dtype=torch.bool, device=dev)
        allowed[0, :, self.committed :] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        out = self.heads(
            torch.tensor([tokens]).to(dev, non_blocking=True),  # (one upload, from a host tensor)
            hidden,
            pos,
            drafter_mask(allowed, self.param.dtype),
            self.cache,
        )
        self.committed += n
        self.last_out = out[0, -1]

    def begin(self, prompt: list[int], root: int, features: torch.Tensor) -> None:
        if self.expansion is not None and self._fits(len(prompt)):
            # reserved: reused, so a captured expansion stays valid
            self.cache = self.expansion.cache
            self.cache.truncate(0)
        else:
            self.cache, self.expansion = self._new_cache(), None
        self.committed = 0
        self._commit(prompt[1:] + [root], features)

    def reserve(self, max_len: int, graphs: Optional[bool] = None) -> None:
        """Size the device expansion's cache for sequences of up to `max_len` tokens, and say
        whether to capture it as a CUDA graph (None: on CUDA); the CUDA backend's loop calls it
        before `begin`."""
        self.reserved, self.graphs = max_len + self.depth * self.top_k, graphs
        if self.expansion is not None and self.expansion.cache.k.shape[1] < self.reserved:
            self.expansion = None

    def _fits(self, length: int) -> bool:
        """Whether the reserved cache holds `length` committed positions and an expansion after
        them."""
        return length + self.depth * self.top_k <= self.expansion.cache.k.shape[1]

    def accept(self, tokens: list[int], features: torch.Tensor) -> None:
        self._commit(tokens, features)

    def draft(self, root: int) -> tuple[torch.Tensor, Tree]:
        return self._select(root, *self.candidates())

    def draft_tensors(self, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft` on the device, for the CUDA backend's loop: root [1] (a device tensor) -> node
        ids [n] and parent indices [n] of the same tree, by the tensor expansion
        (drafters/eagle_device.py) where the drafter's cache is the static one; otherwise the host
        tree, uploaded."""
        if isinstance(self.cache, StaticLayerCache):
            if self.expansion is None:
                room = self.reserved or self.committed + 1024 + self.depth * self.top_k
                self.expansion = EagleExpansion(self, room, self.graphs)
            return self.expansion.run(root)
        nodes, tree = self.draft(int(root))
        return nodes, torch.tensor(tree.parent, dtype=torch.long, device=nodes.device)

    def proposals(
        self, root: int, depth: Optional[int] = None
    ) -> tuple[list[int], list[float], list[int]]:
        """Every expanded candidate for a hybrid tree: target token id, draft probability given its
        parent, and parent candidate (-1: the root; parents come first). depth: levels to expand
        (None: this drafter's)."""
        tokens, scores, parents, _ = self.candidates(depth)
        ids = self.heads.to_target_ids(torch.tensor(tokens, device=self.param.device)).tolist()
        probs = [math.exp(s - (scores[p] if p >= 0 else 0.0)) for s, p in zip(scores, parents)]
        return ids, probs, parents

    @torch.no_grad()
    def candidates(
        self, depth: int | None = None, top_k: int | None = None
    ) -> tuple[list[int], list[float], list[int], list[int]]:
        """Every node the expansion reaches (draft token id, cumulative log-prob, parent index or
        -1, depth), with this drafter's depth and top_k unless given; the drafter cache is left as
        it was."""
        heads, dev = self.heads, self.param.device
        start = time.perf_counter()
        k = top_k or self.top_k
        # Candidates: draft token id, cumulative log-prob, parent candidate (-1: the root), depth.
        values, indices = top_logprobs(heads.logits(self.last_out.view(1, -1)), k)
        tokens = indices[0].tolist()
        scores = values[0].tolist()
        parents = [-1] * k
        depths = [1] * k
        layer = list(range(k))  # the nodes to expand next
        layer_hidden = heads.next_hidden(self.last_out).view(1, 1, -1).expand(1, k, -1)
        self.level_seconds = [time.perf_counter() - start]
        # candidate index -> offset after the committed prefix of its drafter cache entry (added in
        # this step)
        slot_of: dict[int, int] = {}
        for d in range(1, depth or self.depth):
            n_prev = len(slot_of)
            # each row sees the committed prefix, its own slot and its ancestors' slots (set in one
            # indexing call)
            rows, cols = [], []
            for row, c in enumerate(layer):
                rows.append(row)
                cols.append(self.committed + n_prev + row)
                p = parents[c]
                while p >= 0:
                    rows.append(row)
                    cols.append(self.committed + slot_of[p])
                    p = parents[p]
            allowed = torch.zeros(
                1, len(layer), self.committed + n_prev + len(layer), dtype=torch.bool, device=dev
            )
            allowed[0, :, : self.committed] = True
            allowed[0, rows, cols] = True
            ids = heads.to_target_ids(torch.tensor([tokens[c] for c in layer], device=dev)).view(
                1, -1
            )
            pos = torch.full((1, len(layer)), self.committed + d - 1, device=dev)
            out = heads(ids, layer_hidden, pos, drafter_mask(allowed, self.param.dtype), self.cache)
            slot_of.update((c, n_prev + row) for row, c in enumerate(layer))
            child_logp, child_ids = top_logprobs(heads.logits(out[0]), k)
            base = torch.tensor([scores[c] for c in layer], device=dev).unsqueeze(-1)
            cum = (base + child_logp).flatten()
            first = len(tokens)
            tokens += child_ids.flatten().tolist()
            scores += cum.tolist()
            parents += [c for c in layer for _ in range(k)]
            depths += [d + 1] * (len(layer) * k)
            best = cum.topk(min(k, len(cum))).indices.tolist()
            layer = [first + b for b in best]
            layer_hidden = heads.next_hidden(out[0, [b // k for b in best]]).unsqueeze(0)
            self.level_seconds.append(time.perf_counter() - start)
        if isinstance(self.cache, StaticLayerCache):
            self.cache.truncate(self.committed)
        else:
            truncate_cache(self.cache, self.committed)
        return tokens, scores, parents, depths

    def _select(
        self,
        root: int,
        tokens: list[int],
        scores: list[float],
        parents: list[int],
        depths: list[int],
    ) -> tuple[torch.Tensor, Tree]:
        """The `total_tokens` best candidates as a tree; a parent never ranks below its child (its
        score is at least the child's and it is shallower), so every chosen node's ancestors are
        chosen too."""
        order = sorted(range(len(tokens)), key=lambda c: (-scores[c], depths[c], c))[
            : self.total_tokens
        ]
        chosen = set(order)
        rank: dict[int, int] = {}
        seen: dict[int, int] = {}
        for c in sorted(chosen, key=lambda c: (depths[c], -scores[c], c)):
            rank[c] = seen.get(parents[c], 0)
            seen[parents[c]] = rank[c] + 1
        paths: dict[int, tuple[int, ...]] = {}
        for c in sorted(chosen, key=lambda c: depths[c]):
            if parents[c] >= 0 and parents[c] not in chosen:
                raise HeadwayError("internal: a draft node was chosen without its parent")
            paths[c] = (paths[parents[c]] if parents[c] >= 0 else ()) + (rank[c],)
        tree = build_tree(list(paths.values()))
        by_path = {p: c for c, p in paths.items()}
        draft_ids = torch.tensor(
            [tokens[by_path[p]] for p in tree.paths[1:]], device=self.param.device
        )
        nodes = torch.cat(
            [torch.tensor([root], device=draft_ids.device), self.heads.to_target_ids(draft_ids)]
        )
        return nodes, tree

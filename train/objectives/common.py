"""What every kind's training objective shares: the target's side of a batch (`Features`) and the
interface an objective implements (`Objective`).

`Features` is made by running the target (online) or read back from a feature cache (offline): the
objectives cannot tell which, so both modes give the same loss on the same batch. Each kind's
objective lives in its own module beside this one (medusa.py, eagle.py, eagle3.py, dflash.py); its
kind's spec (kinds/<kind>.py) names the class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from headway.train.losses import wide
from headway.train.ttt import shifted


class Features:
    """hidden: HF output_hidden_states index -> [B, T, h]; logits: the target's next-token logits
    [B, T, V], given (online) or recomputed on first use from the last hidden state through
    `model`'s lm_head (offline); argmax: the target's greedy next token [B, T], given by the cache
    or read off the logits."""

    def __init__(
        self,
        hidden: dict[int, torch.Tensor],
        logits: Optional[torch.Tensor] = None,
        model: Any = None,
        argmax: Optional[torch.Tensor] = None,
    ):
        self.hidden = hidden
        self._logits = logits
        self._model = model
        self._argmax = argmax

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            with torch.no_grad():
                self._logits = target_logits(self._model, self.hidden[max(self.hidden)])
        return self._logits

    @property
    def argmax(self) -> torch.Tensor:
        if self._argmax is None:
            self._argmax = self.logits.argmax(-1)
        return self._argmax

    def draft_logits(self, d2t: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary only: just those rows of its lm_head over
        the final hidden state where the model is known (a product a sixth the size of the full one,
        and no gather of columns out of [B, T, V] logits), else those columns of the given
        logits."""
        if self._model is None:
            return self._logits[..., d2t]
        with torch.no_grad():
            return target_logits(self._model, self.hidden[max(self.hidden)], rows=d2t)

    def cat(self, layers: list[int]) -> torch.Tensor:
        return torch.cat([wide(self.hidden[i]) for i in layers], dim=-1)


def target_logits(
    model: Any, last_hidden: torch.Tensor, rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The target's logits from its final (post-norm) hidden state, as its own forward computes
    them; `rows`: only those vocabulary entries."""
    head = model.get_output_embeddings()
    weight = head.weight if rows is None else head.weight[rows.to(head.weight.device)]
    bias = getattr(head, "bias", None)
    if bias is not None and rows is not None:
        bias = bias[rows.to(bias.device)]
    logits = F.linear(last_hidden.to(weight.dtype), weight, bias)
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    cap = getattr(cfg, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def answer_ahead(batch: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """[B, T] bool: the token k positions on is an answer token of the same sequence (loss_mask at t
    + k; in a packed batch, train/packing.py, also of the same `doc`)."""
    answer = shifted(batch["loss_mask"], k).bool()
    if "doc" not in batch:
        return answer
    return answer & (shifted(batch["doc"], k, -2) == batch["doc"])


def at_least_one_row(*index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plan's index tensors of one loss, or one row (0, 0, ...) where they are empty: a
    micro-batch with no loss row for some step still runs that step's read-out on one row weighted
    out on the device, so every loss has a graph (a backward with no graph raises) and every trained
    parameter gets a gradient on every rank (DDP and FSDP2 reduce the same parameters everywhere).
    The objective recomputes the row's validity on the device (`answer_ahead` at it), false for the
    added row."""
    if index[0].numel():
        return index
    return tuple(torch.zeros(1, dtype=i.dtype) for i in index)


class Objective(ABC):
    """A head kind's training objective: what its head learns from the target's features on one
    batch.

    Built once per run from the kind's own config section, as the head was built with (`heads.cfg`:
    head.<kind>, its target-dependent defaults resolved), and the few train settings an objective
    needs, passed by name; it reads nothing else of the run's config. Then called on every
    micro-batch.

    Args:
        cfg: the kind's config section (heads/config.py).
        seed: train.seed, for objectives that draw at random (DFlash's anchors): the same draws on a
            resumed run.
        loss_chunk: rows per chunk of the vocabulary loss (train.loss_chunk resolved; 0: in one
            pass), for the kinds that chunk it (train/chunked_loss.py).
        ttt_attention: train.ttt_attention resolved (structured, flex or recompute), for the kinds
            with a draft attention layer (EAGLE-1, EAGLE-3).
        flex_buckets: train.flex_buckets resolved (train/ttt_flex.py `length_buckets`): with flex,
            the lengths its attention is padded up to (empty: no padding).
    """

    # The batch keys `plan` adds (empty: the kind plans nothing).
    plan_keys: tuple[str, ...] = ()
    # Whether the loss reads the target's full distribution (its logits over the whole vocabulary),
    # not only its argmax and hidden states: with train.target_argmax=data the target's lm_head is
    # skipped otherwise.
    needs_logits: bool = True
    # What the end of training measures on the held-out split and saves with the head (config.json
    # `rank_accuracy`): (target, heads, held-out samples, batch size, t2d) -> value, or None.
    calibrate: Optional[Callable[..., Any]] = None

    def __init__(
        self,
        cfg: Any,
        *,
        seed: int = 0,
        loss_chunk: int = 0,
        ttt_attention: str = "structured",
        flex_buckets: tuple[int, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.loss_chunk = loss_chunk
        self.ttt_attention = ttt_attention
        self.flex_buckets = tuple(flex_buckets) if ttt_attention == "flex" else ()

    def plan(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host-side planning of a micro-batch, on its CPU tensors before they go to the device: the
        index tensors of the positions a loss may read, worked out from loss_mask (known on the
        host), so that the step on the device needs no boolean indexing, no data-dependent shape and
        no host read.

        Args:
            batch: the collated micro-batch on the CPU (input_ids, attention_mask, loss_mask [B,
                T]).
        Returns:
            The entries to add to the batch (named by `plan_keys`), CPU tensors.
        """
        return {}

    def planned(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` with this objective's plan: as given when the training step planned it before the
        upload, else planned here from a copy read back to the host (a direct call, as the tests
        make)."""
        if all(k in batch for k in self.plan_keys):
            return batch
        device = batch["input_ids"].device
        cpu = {k: v.cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        return {**batch, **{k: v.to(device) for k, v in self.plan(cpu).items()}}

    @abstractmethod
    def flops(self, heads: Any, plan: dict[str, torch.Tensor], target: Any) -> float:
        """The head's model FLOPs, forward and backward, on a planned micro-batch (train/flops.py's
        conventions), from its shapes alone.

        Args:
            heads: the head being trained; plan: the micro-batch's host tensors (input_ids [B, T]
                and this objective's plan); target: the target's widths (`flops.Dims`).
        """

    @abstractmethod
    def __call__(
        self, heads: Any, batch: dict, feats: Features, t2d: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) on one micro-batch. batch: input_ids, attention_mask and loss_mask (1 on
        answer tokens), [B, T]; t2d: target id -> draft id (-1 outside the draft vocabulary), or
        None for a full vocabulary."""

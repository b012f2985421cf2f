"""Batched decoding on the static KV cache, with slots refilled as answers finish:
self-distillation's `distill.engine=static`, the way to feed a GPU without vLLM.

The shape follows vLLM's and SGLang's decode loops, in Headway's fixed-shape style
(engines/cuda/runner.py):
- one KV cache of `batch` slots, each `max_len` positions plus one scratch position that an idle
  slot writes;
- a slot runs one answer: its prompt is prefilled alone (eagerly, causal over its own segment), and
  its first token comes from the prompt's last logits;
- one decode step advances every slot by one token: the last tokens, the slots' lengths, their
  produced counts and their active flags are persistent device buffers, and the step updates them on
  the device (greedy argmax, or a sample from the target's distribution with uniforms drawn before
  the step), writing each token into the slot's row of an output buffer. The step reads no host
  value: its every shape is the batch's and the attention span's;
- the span: attention covers the first `end` positions of every slot, `end` rounded up to a multiple
  of `span_block` from the host's bound on the longest occupied slot (a bound it keeps without
  reading the device), so each span is one graph on CUDA (engines/cuda/graphs.py);
- every `check_every` steps the host reads the active flags (one read); finished slots' tokens are
  read once, and those slots take the next prompts.

An answer is what the target writes after its prompt, up to and including the first stop token, or
`max_new_tokens` tokens. Greedy answers equal Hugging Face `generate`'s (tests, float64, four
architectures, every batch size and refill order).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from headway.errors import HeadwayError
from headway.inference.config import SamplingConfig
from headway.inference.engines.cuda.graphs import StepGraphs
from headway.inference.engines.cuda.runner import cuda_supported, pinned_sdpa
from headway.inference.engines.distribution import target_distribution
from headway.inference.engines.kv import KVCache
from headway.inference.engines.layer_step import gqa_sdpa
from headway.inference.engines.step_model import StepModel
from headway.target.families import engine_support, family_of

log = logging.getLogger("headway")


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] by inverse CDF with uniforms [B] in [0, 1): the first token
    whose cumulative probability exceeds u times the row's total. Graph-safe (no host read, no
    generator)."""
    cumulative = probs.cumsum(-1)
    target = uniforms.to(probs.dtype)[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


class _SlotAttend:
    """The decode step's attention as layer_step calls it: row b's query [heads, head_dim] over the
    first `end` positions of slot b's segment of the flat cache [kv, batch * seg, head_dim], under
    `mask` [batch, end]. One query per slot: two batched products and a softmax in float32 (float64
    for a float64 model), which on CPUs runs several times faster than SDPA's masked kernel at this
    shape."""

    def __init__(self, batch: int, seg: int, end: int, mask: torch.Tensor):
        self.batch, self.seg, self.end, self.mask = batch, seg, end, mask

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        b, kv, hd = self.batch, k.shape[0], k.shape[-1]
        if k.dtype in (torch.bfloat16, torch.float16):
            # half caches: SDPA over the cache's own dtype (kernels accumulate in fp32), each slot's
            # query group folded into the query axis (gqa_sdpa), never an fp32 copy of the span's
            # keys and values (on a GPU that copy costs more than the step's weights at 8B, batch
            # 32, span 2K) [b, kv, end, hd] (a view)
            keys = k.view(kv, b, self.seg, hd).transpose(0, 1)[:, :, : self.end]
            vals = v.view(kv, b, self.seg, hd).transpose(0, 1)[:, :, : self.end]
            qg = q.view(b, -1, 1, hd).to(k.dtype)  # [b, heads, 1, hd]
            o = gqa_sdpa(qg, keys, vals, self.mask[:, None, None, :], False, scale, fold=True)
            return o.reshape(b, -1).to(q.dtype)
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32  # (a no-op .to: no copy)
        # [b, kv, end, hd]
        keys = k.view(kv, b, self.seg, hd).transpose(0, 1)[:, :, : self.end].to(cd)
        vals = v.view(kv, b, self.seg, hd).transpose(0, 1)[:, :, : self.end].to(cd)
        qg = q.view(b, kv, -1, hd).to(cd)  # [b, kv, group, hd]: each key-value head's query heads
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [b, kv, group, end]
        scores = scores.masked_fill(~self.mask[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(scores, -1), vals)  # [b, kv, group, hd]
        return o.reshape(b, -1).to(q.dtype)


class _PromptAttend:
    """A prompt's attention, prefilled alone into slot `slot`: causal over its own first n positions
    (and Gemma-3's window, through `mask` [n, n])."""

    def __init__(self, slot: int, seg: int, n: int, mask: Optional[torch.Tensor]):
        self.first, self.n, self.mask = slot * seg, n, mask

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        keys = k[None, :, self.first : self.first + self.n]
        vals = v[None, :, self.first : self.first + self.n]
        o = gqa_sdpa(
            q.transpose(0, 1)[None].to(keys.dtype), keys, vals, self.mask, self.mask is None, scale
        )
        return o[0].transpose(0, 1).reshape(self.n, -1).to(q.dtype)


class SlotBuffers:
    """The decode step's persistent state, one entry per slot: the token to feed (`last`), the cache
    length (`length`: positions written), tokens produced, the answer's token budget (`limit`),
    whether the slot still decodes (`active`), its output row [max_len], and one uniform for the
    next sample."""

    def __init__(self, batch: int, max_len: int, device: torch.device):
        self.last = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.produced = torch.zeros(batch, dtype=torch.long, device=device)
        self.limit = torch.ones(batch, dtype=torch.long, device=device)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(batch, dtype=torch.float64, device=device)


class BatchDecoder:
    """Answers many prompts at once (see the module docstring).

    Args:
        model: a target the CUDA backend runs (engine_cuda.cuda_supported); batch: slots decoded
            together;
        max_len: the most positions one sequence (prompt + answer) takes; stop_ids: tokens that end
            an
        answer; check_every: decode steps between the host's reads of which slots finished;
        span_block: the attention span's granularity (positions); graphs: capture each span's step
            as a CUDA graph (None: on
        CUDA)."""

    def __init__(
        self,
        model: Any,
        batch: int,
        max_len: int,
        stop_ids: list[int],
        check_every: int = 8,
        span_block: int = 256,
        graphs: Optional[bool] = None,
    ):
        if not cuda_supported(model):
            why = (
                engine_support(model.config)["cuda"]
                or "the model lacks the modules the backend calls"
            )
            name = family_of(model.config).name
            raise HeadwayError(
                f"distill.engine=static runs the CUDA backend's targets, not this {name} target ({why}): "
                "use distill.engine=hf for this one (docs/targets.md)"
            )
        if batch < 1 or max_len < 2:
            raise HeadwayError(f"internal: a batch decoder of {batch} slots of {max_len} positions")
        self.batch, self.max_len = batch, max_len
        self.seg = max_len + 1  # the segment of a slot: its positions, then its scratch position
        self.net = StepModel(model, self.seg)
        self.device, self.dtype = self.net.device, self.net.dtype
        self.cache = KVCache(
            len(self.net.layers),
            self.net.kv_heads,
            batch * self.seg,
            self.net.head_dim,
            self.dtype,
            self.device,
        )
        self.stops = torch.tensor(
            sorted(set(stop_ids)) or [-1], dtype=torch.long, device=self.device
        )
        self.check_every, self.span_block = max(1, check_every), max(1, span_block)
        self.buf = SlotBuffers(batch, max_len, self.device)
        self.sampling: Optional[SamplingConfig] = None
        self.graphs = StepGraphs(self._step, self.device, enabled=graphs)
        self.steps = 0  # decode steps run (for throughput figures)

    # -- the device side -------------------------------------------------------------------------------------

    def _next(self, logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Rows' next tokens [B] from logits [B, V]: the first-max argmax, or a sample."""
        if self.sampling is None:
            return logits.argmax(-1)
        return sample_rows(target_distribution(logits, self.sampling), uniforms)

    def _step(self, end: int) -> torch.Tensor:
        """One decode step of every slot over attention span `end`; updates the slot buffers in
        place and returns the active flags [B]."""
        buf, b, seg = self.buf, self.batch, self.seg
        rows = torch.arange(b, device=self.device)
        pos = buf.length
        slots = rows * seg + torch.where(buf.active, pos, torch.full_like(pos, seg - 1))
        cols = torch.arange(end, device=self.device)
        full = cols[None, :] <= pos[:, None]
        masks = {"full_attention": full}
        if self.net.window is not None:  # a key is seen while it is less than the window behind
            masks["sliding_attention"] = full & (pos[:, None] - cols[None, :] < self.net.window)
        at = pos.clamp(max=seg - 1)
        rope = {
            kind: (cos.index_select(0, at), sin.index_select(0, at))
            for kind, (cos, sin) in self.net.rope.items()
        }
        x = self.net.embed(buf.last)
        for i, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
            kind = self.net.kinds[i]
            attend = _SlotAttend(b, seg, end, masks.get(kind, full))
            x = self.net.layer(i, x, *rope[kind], k, v, slots, end, None, attend=attend)
        token = self._next(self.net.logits(self.net.norm(x)), buf.uniforms)
        active = buf.active
        at_out = buf.produced.clamp(max=self.max_len - 1)[:, None]
        kept = buf.out.gather(1, at_out)[:, 0]
        buf.out.scatter_(1, at_out, torch.where(active, token, kept)[:, None])
        step = active.long()
        buf.length.add_(step)
        buf.produced.add_(step)
        done = torch.isin(token, self.stops) | (buf.produced >= buf.limit)
        buf.last.copy_(torch.where(active, token, buf.last))
        buf.active.copy_(active & ~done)
        return buf.active

    def _prefill(self, slot: int, ids: list[int], limit: int) -> None:
        """Prompt `ids` into slot `slot`, eagerly, and its first token into the slot's buffers
        (device writes only: no host read)."""
        n = len(ids)
        first = slot * self.seg
        tokens = torch.tensor(ids, dtype=torch.long).to(self.device)
        slots = first + torch.arange(n, device=self.device)
        sliding = None  # the sliding layers' mask, where the prompt is longer than the window
        if self.net.window is not None and n > self.net.window:
            r = torch.arange(n, device=self.device)
            sliding = (r[:, None] >= r[None, :]) & (r[:, None] - r[None, :] < self.net.window)
        x = self.net.embed(tokens)
        with pinned_sdpa():  # (cuDNN's SDPA builds a plan for every new prompt length)
            for i, (k, v) in enumerate(zip(self.cache.k, self.cache.v)):
                kind = self.net.kinds[i]
                cos, sin = self.net.rope[kind]
                attend = _PromptAttend(
                    slot, self.seg, n, sliding if kind == "sliding_attention" else None
                )
                x = self.net.layer(i, x, cos[:n], sin[:n], k, v, slots, n, None, attend=attend)
        token = self._next(
            self.net.logits(self.net.norm(x[-1:])), self.buf.uniforms[slot : slot + 1]
        )
        buf = self.buf
        buf.out[slot].zero_()
        buf.out[slot, :1].copy_(token)
        buf.last[slot : slot + 1].copy_(token)
        buf.length[slot].fill_(n)
        buf.produced[slot].fill_(1)
        buf.limit[slot].fill_(limit)
        buf.active[slot : slot + 1].copy_(~torch.isin(token, self.stops) & (limit > 1))

    # -- the host loop ---------------------------------------------------------------------------------------

    def set_sampling(self, cfg: Optional[SamplingConfig]) -> None:
        """Greedy (None or temperature 0), else samples from `cfg`'s distribution; a change drops
        the captured graphs (they hold the other rule)."""
        wanted = None if cfg is None or cfg.greedy else cfg
        if wanted != self.sampling:
            self.sampling = wanted
            # (freed now, not by a collection that might run inside the next capture)
            self.graphs.reset()

    def span(self, bound: int) -> int:
        """The attention span for a longest occupied slot of `bound` positions: `bound` rounded up
        to a multiple of `span_block`, at most the segment."""
        return min(self.seg, -(-bound // self.span_block) * self.span_block)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new: int,
        generator: Optional[torch.Generator] = None,
        on_answer: Optional[Callable[[int, list[int]], None]] = None,
    ) -> list[list[int]]:
        """Answer every prompt, in the order given, `batch` at a time, each freed slot refilled at
        once.

        Args:
            prompts: token ids; max_new: the most tokens an answer takes (each prompt with max_new
                must fit max_len); generator: the uniforms' source when sampling (on the device;
                seeded by the caller); on_answer: called with (prompt index, answer) as each
                finishes.
        Returns:
            the answers, in the prompts' order: token ids up to and including the first stop token,
            or max_new tokens."""
        for i, p in enumerate(prompts):
            if not p or len(p) + max_new > self.max_len or max_new < 1:
                raise HeadwayError(
                    f"internal: prompt {i} of {len(p)} tokens with {max_new} new exceeds {self.max_len}"
                )
        answers: list[Optional[list[int]]] = [None] * len(prompts)
        owner: list[Optional[int]] = [None] * self.batch  # the prompt each slot answers
        bound = [0] * self.batch  # the host's bound on each slot's positions after the next step
        queue = iter(range(len(prompts)))
        self.buf.active.zero_()
        pending = True
        while True:
            if pending:
                for s in range(self.batch):
                    if owner[s] is None:
                        j = next(queue, None)
                        if j is None:
                            pending = False
                            break
                        self._draw(generator, s)
                        self._prefill(s, prompts[j], max_new)
                        owner[s], bound[s] = j, len(prompts[j]) + 1
            if all(o is None for o in owner):
                break
            for _ in range(self.check_every):
                end = self.span(max(bound[s] for s in range(self.batch) if owner[s] is not None))
                self._draw(generator)
                self.graphs.run(end)
                self.steps += 1
                for s in range(self.batch):
                    if owner[s] is not None:
                        bound[s] = min(self.seg, bound[s] + 1)
            active = self.read(self.buf.active)  # the finished check: one read
            done = [s for s in range(self.batch) if owner[s] is not None and not active[s]]
            if done:
                idx = torch.tensor(done, device=self.device)
                rows = self.read(torch.cat((self.buf.produced[idx][:, None], self.buf.out[idx]), 1))
                for s, row in zip(done, rows):
                    answers[owner[s]] = row[1 : 1 + row[0]]
                    if on_answer is not None:
                        on_answer(owner[s], answers[owner[s]])
                    owner[s] = None
        return [a if a is not None else [] for a in answers]

    @staticmethod
    def read(t: torch.Tensor) -> list:
        """The loop's device-to-host reads (the finished check, and the finished answers) as
        lists."""
        return t.tolist()

    def _draw(self, generator: Optional[torch.Generator], slot: Optional[int] = None) -> None:
        """Fresh uniforms for the next sample (every slot's, or one slot's), drawn outside the
        step."""
        if self.sampling is None:
            return
        target = self.buf.uniforms if slot is None else self.buf.uniforms[slot : slot + 1]
        target.uniform_(0, 1, generator=generator)

"""The CPU backend of the static engine: `StaticRunner` (a preallocated KV cache and Headway's own
attention around the model's modules, through the C++ layer loop, the row-exact path and the packed
weight formats where they apply), `StaticLayerCache` (the EAGLE drafter's one layer the same way),
`LazyLogits` (logits a row at a time, as a greedy walk reads them) and `ModelEngine` (what one model
keeps across sequences).

It also runs on other devices (without the CPU-only machinery); the CUDA backend is
engines/cuda/runner.py.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.inference.engines.kv import KVCache
from headway.inference.engines.layer_step import (
    STATIC_FAMILIES,
    LayerPlan,
    _lean_norm,
    _rms_norm_fn,
    decoder_stack,
    layer_step,
    moe_block,
    rope_tables,
)
from headway.inference.engines.static import layer_loop
from headway.inference.engines.static.plans import _ACTIVE, RowAttention, TransposedKeys
from headway.inference.engines.tree import Tree
from headway.runtime import native_bf16
from headway.target.packed_model import fewest_rows, linear_weights, rows_for_one


class StaticLayerCache:
    """The EAGLE drafter's KV cache: one decoder layer's keys and values in a preallocated buffer
    that doubles when full. Passed as the `cache` of an EAGLE head's forward, it runs the layer
    itself (`run`), so drafting skips transformers' cache and mask machinery; `truncate` drops the
    expansion entries after a draft. Where the C++ layer loop covers the layer (`loop`: the target's
    target.layer_loop), the layer runs there as one call, with the fused element-wise kernels for
    bf16 rows when `fused` (the target's target.fused_ops): a draft step makes a few calls instead
    of about sixty small ones, whose Python cost matched the kernels'."""

    def __init__(self, decoder: Any, capacity: int = 512, loop: str = "auto", fused: bool = True):
        layer = decoder.layers[0]
        self.kv_heads = int(text_config(decoder.config).num_key_value_heads)
        self.head_dim = int(layer.self_attn.head_dim)
        p = next(decoder.parameters())
        self.k = torch.empty(self.kv_heads, capacity, self.head_dim, dtype=p.dtype, device=p.device)
        self.v = torch.empty_like(self.k)
        self.length = 0
        self.plan = LayerPlan(layer, lean=True)
        self.rotary = decoder.rotary_emb
        # rotary tables by position, extended as positions grow: the same values rotary_emb gives
        # per call (each is a function of its position alone), where the rotary does not rescale
        # with the length (dynamic types)
        self.rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        kind = str(getattr(self.rotary, "rope_type", "default"))
        self.rope_by_position = "dynamic" not in kind and "longrope" not in kind
        self.loop, self.emb_norm = self._build_loop(layer, decoder, loop, p.device.type)
        self.fused = fused and p.dtype == torch.bfloat16
        # the device expansion's rows (drafters/eagle_device.py): the slots the next `run` writes,
        # as a device tensor; its attention then spans the whole buffer under a mask of that width,
        # and the length stays
        self.at: Optional[torch.Tensor] = None
        # reserved: the buffers never move again (a captured graph holds their addresses)
        self.fixed = False

    def _build_loop(
        self, layer: Any, decoder: Any, mode: str, device: str
    ) -> tuple[Optional[Any], Any]:
        """The C++ loop over this one layer (EAGLE-3's fused input norm: its hidden half as the
        layer's norm, its embedding half passed per call) and that embedding norm; (None, None)
        where the Python step runs."""
        norm = layer.input_layernorm
        split = getattr(norm, "hidden_norm", None), getattr(norm, "emb_norm", None)
        if device != "cpu" or not all(_lean_norm(n) for n in split):
            return None, None
        plan = LayerPlan(layer, lean=True)
        plan.norm1 = _rms_norm_fn(split[0], lean=True)
        # the loop's final norm is unused (`draft` returns the layer's raw output); any RMSNorm of
        # the width serves
        return layer_loop.build_loop([plan], split[0], mode), _rms_norm_fn(split[1], lean=True)

    @staticmethod
    def supported(decoder: Any) -> bool:
        cfg = text_config(decoder.config)
        return (
            getattr(cfg, "model_type", None) in STATIC_FAMILIES
            and getattr(cfg, "sliding_window", None) is None
            and len(getattr(decoder, "layers", ())) == 1
            and hasattr(decoder, "rotary_emb")
        )

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, capacity: int, x: torch.Tensor) -> None:
        """Grow the buffers once to `capacity` slots and the rotary tables to as many positions (x:
        any tensor of the layer's dtype and device), and never move them again."""
        if self.k.shape[1] < capacity:
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(self.kv_heads, capacity, self.head_dim)
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        # the expansion's attention spans the whole buffer, masked: a masked slot weighs exactly 0,
        # unless it holds a NaN or an infinity (fresh memory may), which would poison the row
        self.k[:, self.length :].zero_()
        self.v[:, self.length :].zero_()
        self._rope_tables(x, torch.zeros(1, 1, dtype=torch.long, device=x.device), self.k.shape[1])
        self.fixed = True

    def _rope_tables(
        self, x: torch.Tensor, position_ids: torch.Tensor, top: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` at these positions [1, n], each below `top` (a bound the caller knows: a
        drafter position never exceeds its slot, so reading the largest from the device is not
        needed)."""
        if not self.rope_by_position:
            return rope_tables(*self.rotary(x, position_ids))
        if self.rope is None or self.rope[0].shape[0] < top or self.rope[0].dtype != x.dtype:
            size = max(
                top, 2 * (0 if self.rope is None else self.rope[0].shape[0]), self.k.shape[1]
            )
            every = torch.arange(size, device=x.device).unsqueeze(0)
            self.rope = rope_tables(*self.rotary(x, every))
        return self.rope[0][position_ids[0]], self.rope[1][position_ids[0]]

    def run(
        self,
        decoder: Any,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The layer over x [1, n, h] at the next n slots; `mask` [1, 1, n, length + n] as the
        drafter builds it (with `at` set: at slots `at`, `mask` [1, 1, n, capacity])."""
        if x.shape[0] != 1:
            raise HeadwayError(
                "internal: the drafter's static cache decodes one sequence at a time"
            )
        start, n = self.length, x.shape[1]
        if self.at is not None:
            cos, sin = self._rope_tables(x, position_ids, self.k.shape[1])
            end = self.k.shape[1]
            return layer_step(self.plan, x[0], cos, sin, self.k, self.v, self.at, end, mask[0, 0])[
                None
            ]
        if start + n > self.k.shape[1]:
            if self.fixed:
                raise HeadwayError(
                    f"internal: the drafter's reserved cache of {self.k.shape[1]} slots overflows "
                    f"({start} + {n})"
                )
            grow = max(2 * self.k.shape[1], start + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(self.kv_heads, grow, self.head_dim)
                new[:, :start] = old[:, :start]
                setattr(self, name, new)
        cos, sin = self._rope_tables(x, position_ids, start + n)
        slots = torch.arange(start, start + n, device=x.device)
        mask = None if mask is None else mask[0, 0]
        embedding = getattr(decoder.layers[0].input_layernorm, "embedding", None)
        if self.loop is not None and embedding is not None:
            emb = embedding.reshape(n, -1).contiguous()
            out = self.loop.draft(
                x[0].contiguous(),
                emb,
                self.emb_norm.weight,
                self.emb_norm.eps,
                cos,
                sin,
                self.k,
                self.v,
                slots,
                start + n,
                mask,
                self.fused,
            )
        else:
            out = layer_step(self.plan, x[0], cos, sin, self.k, self.v, slots, start + n, mask)
        self.length = start + n
        return out[None]


class LazyLogits:
    """The target's logits, a row at a time as they are read: a greedy tree walk reads only the root
    and the accepted nodes, plain decoding and the prefill only the last position. `row` maps hidden
    rows [k, H] to their logits [k, V] (see `StaticRunner._lm_row_fn`); `together(i)`, where given,
    names the rows to compute with row i in one call (row i first): where a few rows cost what one
    does, the nodes a walk may read next come free."""

    def __init__(self, hidden: torch.Tensor, row: Any, together: Optional[Any] = None):
        self.hidden, self.row, self.together = hidden, row, together
        self.rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i) % len(self)
        if i not in self.rows:
            if self.together is None:
                self.rows[i] = self.row(self.hidden[i : i + 1])[0]
            else:
                want = [j for j in self.together(i) if j not in self.rows]
                for j, logits in zip(want, self.row(self.hidden[want])):
                    self.rows[j] = logits
        return self.rows[i]


def subtree_first(tree: Tree, count: int) -> Any:
    """together(i) for LazyLogits: node i and the first nodes below it, breadth first in rank order
    (its best children, or the next nodes of a chain), `count` in all."""

    def together(i: int) -> list[int]:
        out, j = [i], 0
        while j < len(out) and len(out) < count:
            out.extend(tree.children[out[j]][: count - len(out)])
            j += 1
        return out

    return together


class ModelEngine:
    """What the static engine keeps for one target model across sequences: its decoder layers as
    LayerPlans, its compiled decoder stack, its lm_head transposed (float32 CPUs) and the KV buffers
    (one pair per layer) that each new runner of the model reuses, grown when too small. The model
    owns it (`ModelEngine.of`), as gpt-fast's model owns its KV cache, so it lives and goes with the
    model."""

    def __init__(self) -> None:
        self._plans: dict[bool, list[LayerPlan]] = {}
        self._compiled: Any = None
        self._lm_t: Optional[torch.Tensor] = None
        self._kv: Optional[KVCache] = None
        self._kt: Optional[TransposedKeys] = None
        self._loops: dict[str, Any] = {}

    @classmethod
    def of(cls, model: Any) -> "ModelEngine":
        """The model's engine state, made on first use, in a weak table keyed by the model
        (`_ENGINES`; never an attribute of the model): it holds the model's layers, not the model,
        so it goes with the model."""
        engine = _ENGINES.get(model)
        if engine is None:
            engine = _ENGINES[model] = cls()
        return engine

    def layer_plans(self, model: Any, lean: bool) -> list[LayerPlan]:
        """The model's decoder layers as LayerPlans, once per kind."""
        if lean not in self._plans:
            self._plans[lean] = [LayerPlan(layer, lean) for layer in model.model.layers]
        return self._plans[lean]

    def compiled_stack(self) -> Any:
        """`decoder_stack` under torch.compile, once per model. Shapes are dynamic: one graph serves
        every tree size, prompt length and cache length, and torch's 0/1 specialisation adds one for
        single tokens; two graphs in all, so no tree-size buckets or padding are needed. The first
        two calls compile (minutes for the default target on one CPU core); torch keeps the result
        in its on-disk cache, so later runs start
        in seconds."""
        if self._compiled is None:
            # freezing: the target's weights are constants of the graph, so inductor prepacks them
            # for the CPU's GEMM kernels (oneDNN/MKL).
            compiled = torch.compile(decoder_stack, dynamic=True, options={"freezing": True})

            def run(*args: Any) -> Any:
                # no duck sizing: sizes equal by chance when a graph compiles (a tree's 3 rows and
                # the target's 3 key/value heads) would be tied by a guard, and the next step would
                # compile another graph
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return compiled(*args)

            self._compiled = run
        return self._compiled

    def layer_loop(self, model: Any, mode: str) -> Any:
        """The C++ layer loop over the model's lean LayerPlans (`layer_loop.build_loop`), once per
        mode; None where the Python loop runs."""
        if mode not in self._loops:
            plans = self.layer_plans(model, lean=True)
            self._loops[mode] = layer_loop.build_loop(plans, model.model.norm, mode)
        return self._loops[mode]

    def lm_head_t(self, weight: torch.Tensor) -> torch.Tensor:
        """The lm_head weight [V, H] transposed to [H, V], contiguous, kept while its dtype
        holds."""
        if self._lm_t is None or self._lm_t.dtype != weight.dtype:
            self._lm_t = weight.t().contiguous()
        return self._lm_t

    def kv_cache(
        self, layers: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        """The KV cache for `layers` layers of [kv_heads, max_len, head_dim] each: the kept one when
        long enough and of this dtype and device (a runner starts empty by its length, not by
        clearing it)."""
        kv_heads, max_len, head_dim = shape
        if self._kv is None or not self._kv.fits(
            layers, kv_heads, max_len, head_dim, dtype, device
        ):
            # free the old one first: the cache is the largest thing a runner allocates
            self._kv = None
            self._kv = KVCache(layers, kv_heads, max_len, head_dim, dtype, device)
        return self._kv

    def transposed_keys(self, keys: list[torch.Tensor]) -> TransposedKeys:
        """The row attention kernel's transposed copy of these key buffers, shared by every runner
        of them."""
        if self._kt is None or self._kt.keys is not keys:
            self._kt = TransposedKeys(keys)
        return self._kt


_ENGINES: "weakref.WeakKeyDictionary[Any, ModelEngine]" = weakref.WeakKeyDictionary()


class StaticRunner:
    """A preallocated KV cache (per layer [kv_heads, max_len, head_dim]) and Headway's own
    attention; with `compiled`, the decoder stack runs under torch.compile. `loop`, `row_attention`,
    `fused_ops`, `prompt_attention`: the target.layer_loop, target.row_attention, target.fused_ops
    and target.prompt_attention settings (engine_options.EngineOptions; the model holds none of
    them)."""

    accepts_on_device = False  # (Runner protocol: engines/runner.py)

    def __init__(
        self,
        model: Any,
        max_len: int,
        compiled: bool = False,
        loop: str = "auto",
        row_attention: str = "auto",
        fused_ops: bool = True,
        prompt_attention: str = "auto",
    ):
        cfg = text_config(model.config)
        self.model, self.base = model, model.model
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(cfg.num_key_value_heads)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._lm_row = self._lm_row_fn(model)
        self.compiled = compiled
        if compiled and any(moe_block(layer.mlp) for layer in self.layers):
            raise HeadwayError(
                "inference.engine=compiled does not run MoE layers (their row-by-row routing reads the host "
                "mid-step): use inference.engine=static"
            )
        state = ModelEngine.of(model)
        self._stack = state.compiled_stack() if compiled else decoder_stack
        # eager steps: the decoder layers in one C++ call where it builds and covers them (same
        # bits) (loop: auto, cpp or python: target.layer_loop)
        if compiled or self.device.type != "cpu":
            self._loop = None
        else:
            self._loop = state.layer_loop(model, layer_loop.loop_mode(loop))
        # bf16/fp16 on CPUs: decoding steps compute every row as a one-token step would
        # (`_row_exact`); compiled, a single token pads to 2 rows too, so that every step runs the
        # one graph of dynamic row count
        self.row_exact = _row_exact_dtype(self.dtype, self.device)
        # (row_attention: auto, cpp or sdpa: target.row_attention)
        self.row_kernel = (
            layer_loop.row_kernel(layer_loop.row_attention_mode(row_attention))
            if self.row_exact
            else None
        )
        self.fewest_rows = max(fewest_rows(model), 2 if compiled else 1)
        self.lm_rows_free = rows_for_one(model)
        self.plans = state.layer_plans(model, lean=True)
        self.compiled_plans = state.layer_plans(model, lean=False) if compiled else None
        # row-exact: keys and values kept in float32 (exactly the bf16/fp16 values), the dtype a
        # row's attention runs in; a prompt's many rows attend in bf16 where the CPU has native bf16
        # kernels (AMX's run a 1,000-token prompt's attention ~2.5x faster than float32's). Plain
        # and speculative decoding share the prompt.
        cache_dtype = torch.float32 if self.row_exact else self.dtype
        self.prompt_attn_dtype = (
            torch.bfloat16
            if self.row_exact and self.dtype == torch.bfloat16 and native_bf16(self.device)
            else None
        )
        self.cache = state.kv_cache(
            len(self.layers), (self.kv_heads, max_len, self.head_dim), cache_dtype, self.device
        )
        self.k, self.v = self.cache.k, self.cache.v
        self.kt = state.transposed_keys(self.k) if self.row_kernel is not None else None
        # bf16 and float32 steps through the C++ loop's fused element-wise kernels
        # (target.fused_ops)
        self.fused_ops = (
            fused_ops and self._loop is not None and self.dtype in (torch.bfloat16, torch.float32)
        )
        # a fresh prompt's attention in the C++ loop: Headway's kernel, on bf16 brgemm in the fused
        # loop where the CPU has it (AMX), else there on float32 brgemm over the bf16 values where
        # the CPU has AVX-512 (AVX512-BF16), and for float32 targets on float32 brgemm where the CPU
        # has AVX-512
        mode = prompt_attention
        self.prompt_kernel = mode == "auto" and (
            (
                self.fused_ops
                and self.prompt_attn_dtype == torch.bfloat16
                and (
                    layer_loop.extension().prompt_attention_available()
                    or layer_loop.extension().prompt_attention_f32_available()
                )
            )
            or (
                self._loop is not None
                and self.dtype == torch.float32
                and layer_loop.extension().prompt_attention_f32_available()
            )
        )
        self.max_len = max_len
        self.length = 0

    def forward(
        self, ids: torch.Tensor, tree: Optional[Tree] = None, hidden: bool = False
    ) -> tuple[torch.Tensor, Any]:
        ids = ids.view(-1).to(self.device)
        n, start = ids.shape[0], self.length
        if start + n > self.max_len:
            raise RuntimeError(
                f"internal: static cache of {self.max_len} positions overflows ({start} + {n})"
            )
        if self.kt is not None:
            self.kt.written(start)
        if self.row_exact and (n == 1 or tree is not None):
            return self._row_exact(ids, tree, hidden)
        slots = torch.arange(start, start + n, device=self.device)
        mask = None  # one token (a chain step, or a tree that is only its root) sees every slot
        # a prompt at the cache's start: the attention kernel's causal path, cheaper than a dense
        # mask
        causal = tree is None and n > 1 and start == 0
        if tree is None:
            positions = slots
            if n > 1 and not causal:
                mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
        else:
            positions = start + tree.depth.to(self.device)
            if n > 1:
                mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device)
                mask[:, start:] = tree.ancestors.to(self.device)
        x = self.base.embed_tokens(ids).view(1, n, -1)
        cos, sin = self.base.rotary_emb(x, positions.view(1, -1))
        # Compiled: the two graphs are one token and a tree. A prompt (a chain of many tokens, once
        # per sequence) runs eagerly, and the graphs always give the hidden states (free inside
        # them) rather than compiling twice.
        compiled = self.compiled and (n == 1 or tree is not None)
        x, states = self._run_stack(
            x,
            cos,
            sin,
            slots,
            start + n,
            mask,
            hidden,
            causal=causal,
            compiled=compiled,
            attn_dtype=self.prompt_attn_dtype,
            grouped=tree is None and n > 1,
        )
        self.length = start + n
        return self._logits(x[0], tree), tuple(states) if hidden else None

    def _run_stack(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        end: int,
        mask: Optional[torch.Tensor],
        hidden: bool,
        attend: Optional[RowAttention] = None,
        causal: bool = False,
        compiled: bool = False,
        attn_dtype: Optional[torch.dtype] = None,
        grouped: bool = False,
    ) -> tuple[torch.Tensor, list]:
        """`decoder_stack` over x [1, n, hidden]: under torch.compile (`compiled`; its graphs always
        give the hidden states, and read `attend` from _ACTIVE), else in the C++ layer loop where
        there is one, else in Python. `grouped`: a prompt's rows (see `layer_step`)."""
        args = (x, cos, sin, self.k, self.v, slots, end, mask)
        if compiled:
            _ACTIVE[0] = attend
            try:
                return self._stack(self.compiled_plans, self.base.norm, *args, True, attend)
            finally:
                _ACTIVE[0] = None
        if self._loop is None:
            return decoder_stack(
                self.plans, self.base.norm, *args, hidden, attend, causal, attn_dtype, grouped
            )
        plan = None if attend is None else layer_loop.row_plan(attend)
        kts = [] if attend is None or attend.transposed is None else attend.transposed.buffers
        x, states = self._loop.run(
            x[0],
            *rope_tables(cos, sin),
            self.k,
            self.v,
            kts,
            slots,
            end,
            mask,
            causal,
            plan,
            hidden,
            attn_dtype,
            self.fused_ops,
            self.prompt_kernel,
        )
        return x[None], [h[None] for h in states]

    def _logits(self, hidden: torch.Tensor, tree: Optional[Tree]) -> LazyLogits:
        """The step's logits, by row; where the lm_head computes a few rows for the price of one
        (`rows_for_one`), a tree's row comes with the nodes below it that the walk may read next."""
        if tree is None or tree.size == 1 or self.lm_rows_free < 2:
            return LazyLogits(hidden, self._lm_row)
        return LazyLogits(hidden, self._lm_row, subtree_first(tree, self.lm_rows_free))

    def _row_exact(self, ids: torch.Tensor, tree: Optional[Tree], hidden: bool) -> tuple[Any, Any]:
        """A decoding step (one token, or a tree) whose every row is bit-identical to a one-token
        step of that row's token after its accepted ancestors, so that greedy speculative decoding
        equals plain decoding in bf16 too. Two things differ with the row count in bf16 on CPUs: a
        linear over one row (it takes another kernel than 2 or more rows, which agree with each
        other), and fused attention (see RowAttention). So a single token runs as two or more
        identical rows (`fewest_rows`), and attention runs per row over exactly the slots it sees.
        The prompt runs normally: plain and speculative decoding share it."""
        n, start = ids.shape[0], self.length
        if tree is None:
            depth, tails = [0], [[start]]
        else:
            depth = tree.depth.tolist()
            anc = tree.ancestors.tolist()
            tails = [
                sorted((start + j for j in range(n) if anc[i][j]), key=lambda s: depth[s - start])
                for i in range(n)
            ]
        # a step of fewer rows than the format's `fewest_rows` pads with copies of its first: the
        # same token, written to the same slot
        rows = max(n, self.fewest_rows)
        pick = torch.cat([torch.arange(n), torch.zeros(rows - n, dtype=torch.long)]).to(self.device)
        slots = start + pick
        positions = start + torch.tensor(depth, device=self.device)[pick]
        x = self.base.embed_tokens(ids[pick]).view(1, rows, -1)
        cos, sin = self.base.rotary_emb(x, positions.view(1, -1))
        attend = RowAttention(
            start, [tails[i] for i in pick.tolist()], self.device, self.row_kernel, self.kt
        )
        x, states = self._run_stack(
            x, cos, sin, slots, start + n, None, hidden, attend, compiled=self.compiled
        )
        if self.kt is not None:  # every layer's kernel filled in the complete blocks below start
            self.kt.valid = start // 16 * 16
        self.length = start + n
        x, states = x[:, :n], [h[:, :n] for h in states]
        return self._logits(x[0], tree), tuple(states) if hidden else None

    def _lm_row_fn(self, model: Any) -> Any:
        """One row of logits: the model's own lm_head where its weights are packed (float16), else a
        [1, H] x [H, V] product against the pre-transposed weight in float32/64 on CPUs (much faster
        there than a linear), else a plain one-row linear (bf16 on CPUs, GPUs)."""
        if linear_weights(model) != "native":
            return model.lm_head
        lm = model.lm_head.weight.detach()
        if self.device.type == "cpu" and self.dtype in (torch.float32, torch.float64):
            lm_t = ModelEngine.of(model).lm_head_t(lm)
            return lambda h: h @ lm_t
        return lambda h: F.linear(h, lm)

    def keep(self, tree_size: int, keep: list[int]) -> None:
        first = self.length - tree_size
        if self.kt is not None:
            self.kt.written(first)
        # a path that is the tree's first nodes in order (the root alone, the head of a chain) is
        # already in place
        if keep != list(range(len(keep))):
            self.cache.compact(first, torch.tensor(keep, device=self.device) + first)
        self.length = first + len(keep)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def _row_exact_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"

"""Target runners: the decoding loops' one interface to the target's forward pass and KV cache.

`HFRunner` calls the model's own forward with a transformers cache: any architecture transformers runs.
`StaticRunner` keeps the keys and values in preallocated tensors and runs its own attention around the
model's own modules (embedding, norms, projections, MLP, rotary embedding), so it follows the model's
family without a forked modeling file. It has no per-step reallocation, compacts an accepted tree path
in place, and skips transformers' mask and cache machinery. Llama-style families with full attention
(llama, qwen2, mistral without a sliding window) are supported; others use `HFRunner`. Both give the same
logits (tests compare them in float64). `StaticLayerCache` runs the EAGLE drafter's one layer the same way
(`layer_step` is the layer body both share). The compiled engine is the static one with its decoder stack
under torch.compile (`ModelEngine.compiled_stack`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F

from headway.errors import HeadwayError
from headway.heads.draft_layer import text_config
from headway.inference import layer_loop
from headway.inference.cache import (
    cache_kwarg,
    cache_length,
    keep_tree_nodes,
    new_cache,
    sliding_window_limit,
    truncate_cache,
)
from headway.inference.tree import Tree, tree_attention_bias
from headway.runtime import native_bf16
from headway.target.packed_formats import row_linear
from headway.target.packed_fusion import fused_projections
from headway.target.packed_model import fewest_rows, linear_weights, rows_for_one

STATIC_FAMILIES = ("llama", "qwen2", "mistral")


class Runner(Protocol):
    def forward(
        self, ids: torch.Tensor, tree: Optional[Tree] = None, hidden: bool = False
    ) -> tuple[Any, Any]:
        """Logits [n, V] (a tensor, or LazyLogits: rows by index) of `ids` (a chain continuing the cache, or
        the nodes of `tree` rooted after it) and, with `hidden`, the hidden states indexed as transformers'
        output_hidden_states (batch row 0 first)."""

    def keep(self, tree_size: int, keep: list[int]) -> None:
        """Of the last `tree_size` cache entries keep those at indices `keep` (the accepted path)."""

    def truncate(self, length: int) -> None:
        """Forget every cache entry past the first `length`."""


class HFRunner:
    """The model's own forward and a transformers DynamicCache."""

    def __init__(self, model: Any):
        self.model = model
        self.cache = new_cache(model)
        self.kw = cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @property
    def length(self) -> int:
        return cache_length(self.cache)

    def forward(
        self, ids: torch.Tensor, tree: Optional[Tree] = None, hidden: bool = False
    ) -> tuple[torch.Tensor, Any]:
        extra: dict[str, Any] = {}
        if tree is not None:
            prefix = self.length
            extra = {
                "position_ids": (prefix + tree.depth.to(self.device)).view(1, -1),
                "attention_mask": tree_attention_bias(tree, prefix, self.dtype, self.device),
            }
        o = self.model(
            ids.view(1, -1).to(self.device),
            use_cache=True,
            output_hidden_states=hidden,
            **{self.kw: self.cache},
            **extra,
        )
        return o.logits[0], o.hidden_states

    def keep(self, tree_size: int, keep: list[int]) -> None:
        keep_tree_nodes(self.cache, tree_size, keep)

    def truncate(self, length: int) -> None:
        truncate_cache(self.cache, length)


def static_supported(model: Any) -> bool:
    cfg = text_config(model.config)
    base = getattr(model, "model", None)
    return (
        getattr(cfg, "model_type", None) in STATIC_FAMILIES
        and sliding_window_limit(model) is None
        and base is not None
        and hasattr(base, "layers")
        and hasattr(base, "rotary_emb")
    )


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary cos/sin [1, n, head_dim] as `layer_step` takes them: [n, 1, head_dim] (over every
    head), sin with its first half negated, so that rotating x is x * cos + (x's halves swapped) * sin: the
    same products as transformers' rotate_half, each rounded the same, with two ops fewer."""
    half = sin.shape[-1] // 2
    return cos[0, :, None], torch.cat((-sin[0, :, None, :half], sin[0, :, None, half:]), dim=-1)


class LeanRMSNorm:
    """An RMSNorm as a plain callable, in transformers' own arithmetic for the static families (a `weight` and
    a `variance_epsilon`), without the module's dispatch; its weight and eps are what the C++ layer
    loop reads."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rms_norm_fn(norm: Any, lean: bool) -> Any:
    """The layer's RMSNorm as a `LeanRMSNorm` (lean), else the module."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not lean or weight is None or eps is None:
        return norm
    return LeanRMSNorm(weight, eps)


class LayerPlan:
    """One Llama-style decoder layer as `layer_step` runs it: its norms, projections and MLP as callables over
    rows [n, hidden], and its attention's sizes. Lean (eager decoding), the callables skip nn.Module dispatch
    and call the weights' kernels directly (`row_linear`); else (under torch.compile, which traces them)
    they are
    the modules."""

    def __init__(self, layer: Any, lean: bool):
        a, mlp = layer.self_attn, layer.mlp
        cfg = a.config
        self.head_dim = int(a.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.scaling = float(a.scaling)
        self.norm1 = _rms_norm_fn(layer.input_layernorm, lean)
        self.norm2 = _rms_norm_fn(layer.post_attention_layernorm, lean)
        fn = row_linear if lean else (lambda m: m)
        qkv = fused_projections(a, "headway_qkv")
        if qkv is not None:
            self.qkv = fn(qkv.linear)
        else:
            q, k, v = fn(a.q_proj), fn(a.k_proj), fn(a.v_proj)
            self.qkv = lambda h: torch.cat((q(h), k(h), v(h)), dim=-1)
        self.o = fn(a.o_proj)
        gate_up = fused_projections(mlp, "headway_gate_up")
        self.mlp, self.gate_up = mlp, None if gate_up is None else fn(gate_up.linear)
        self.down, self.act = fn(mlp.down_proj), mlp.act_fn
        self.inter = 0 if gate_up is None else gate_up.sizes[0]
        # the modules behind qkv (one fused or three), o, gate_up (one fused or gate and up) and down, for the
        # C++ layer loop
        self.linears = (
            [qkv.linear] if qkv is not None else [a.q_proj, a.k_proj, a.v_proj],
            a.o_proj,
            [gate_up.linear] if gate_up is not None else [mlp.gate_proj, mlp.up_proj],
            mlp.down_proj,
        )


def layer_step(
    plan: LayerPlan,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    end: int,
    mask: Optional[torch.Tensor],
    attend: Optional["RowAttention"] = None,
    causal: bool = False,
    attn_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """One Llama-style decoder layer over rows x [n, hidden]: its keys and values go into cache slots `slots`
    [n] of k_cache/v_cache [kv_heads, max_len, head_dim] (in place, in the cache's dtype), and its queries
    attend to slots [0, end) under `mask` (bool or additive, [n, end] or broadcastable; None: every slot), or
    by `attend`; `causal` (a prompt at the cache's start, no mask): row i sees slots [0, i], through the
    kernel's causal path. `attn_dtype`: the dtype that attention (not `attend`) runs in; None: the cache's.
    cos/sin: `rope_tables`. The layer's own weights do the projections, norms and MLP; only the cache and the
    attention are Headway's. (index_copy_ at a slot tensor, not a slice assignment at a Python offset:
    torch.compile then updates the cache in place.)"""
    n, hd, heads, kv = x.shape[0], plan.head_dim, plan.heads, plan.kv_heads
    qkv = plan.qkv(plan.norm1(x))
    # the queries' and keys' heads rotate together: [n, heads + kv_heads, head_dim]
    qk = qkv[:, : (heads + kv) * hd].view(n, heads + kv, hd)
    qk = qk * cos + qk.view(n, heads + kv, 2, hd // 2).flip(2).view(n, heads + kv, hd) * sin
    q, k = qk[:, :heads], qk[:, heads:]
    v = qkv[:, (heads + kv) * hd :].view(n, kv, hd)
    k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
    if attend is None:
        adt = attn_dtype or k_cache.dtype
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(adt),
            k_cache[None, :, :end].to(adt),
            v_cache[None, :, :end].to(adt),
            attn_mask=mask,
            is_causal=causal,
            scale=plan.scaling,
            enable_gqa=True,
        )
        o = o[0].transpose(0, 1).reshape(n, -1).to(x.dtype)
    else:
        o = attend(q, k_cache, v_cache, plan.scaling)
    x = x + plan.o(o)
    h = plan.norm2(x)
    if plan.gate_up is None:
        return x + plan.mlp(h)
    gate_up = plan.gate_up(h)
    return x + plan.down(plan.act(gate_up[:, : plan.inter]) * gate_up[:, plan.inter :])


def decoder_stack(
    plans: list,
    norm: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ks: list,
    vs: list,
    slots: torch.Tensor,
    end: int,
    mask: Optional[torch.Tensor],
    hidden: bool,
    attend: Optional["RowAttention"] = None,
    causal: bool = False,
    attn_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, list]:
    """Every decoder layer (`layer_step`, plans[i] on caches ks[i]/vs[i]) over x [1, n, hidden] and the final
    norm: the normed output [1, n, hidden] and, with `hidden`, the hidden states as transformers'
    output_hidden_states gives them (the last one normed). cos/sin: the model's rotary embedding [1, n,
    head_dim]. The unit `inference.engine=compiled` hands to torch.compile."""
    cos, sin = rope_tables(cos, sin)
    x = x[0]
    states = [x] if hidden else []
    for plan, k, v in zip(plans, ks, vs):
        x = layer_step(plan, x, cos, sin, k, v, slots, end, mask, attend, causal, attn_dtype)
        if hidden:
            states.append(x)
    x = norm(x)
    if hidden:
        states[-1] = x
    return x[None], [h[None] for h in states]


def _row_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: "RowAttention", scale: float
) -> torch.Tensor:
    """RowAttention's computation over q [n, heads, head_dim] -> [n, heads * head_dim]: the C++ kernel
    (`plan.kernel`), or SDPA: rows `plan.order`, group after group, attend to their slots (read in place, or
    gathered into `plan.slots` in that order)."""
    if plan.kernel is not None:
        kt = None if plan.transposed is None else plan.transposed.of(k_cache)
        return plan.kernel(q, k_cache, v_cache, plan.start, plan.tails, plan.lens, scale, kt, plan.kt_valid)
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    # in float32: the CPU's fused attention is much faster there than in bf16 for one query
    # (docs/inference.md); the row-exact runners keep their cache in float32, so that no step converts it
    if plan.slots is not None:
        k_all, v_all = (
            k_cache.index_select(1, plan.slots).float(),
            v_cache.index_select(1, plan.slots).float(),
        )
    q_all = (
        (q if plan.in_order else q.index_select(0, plan.order)).unsqueeze(2).float()
    )  # [rows, heads, 1, head_dim]
    outs, slot, row = [], 0, 0
    for b, length, in_place in plan.groups:
        if in_place:
            k, v = k_cache[None, :, :length].float(), v_cache[None, :, :length].float()
        else:
            k = k_all[:, slot : slot + b * length].view(kv_heads, b, length, head_dim).transpose(0, 1)
            v = v_all[:, slot : slot + b * length].view(kv_heads, b, length, head_dim).transpose(0, 1)
            slot += b * length
        outs.append(F.scaled_dot_product_attention(q_all[row : row + b], k, v, scale=scale, enable_gqa=True))
        row += b
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).view(q.shape[0], -1)
    if not plan.in_order:
        out = torch.empty_like(out).index_copy_(0, plan.order, out)
    return out.to(q.dtype)


# Under torch.compile RowAttention is one opaque op that reads the step's plan (its rows, slots and groups)
# from here, set by the runner around the compiled call: as graph inputs or structure, the plan's sizes would
# compile a graph for each tree shape.
_ACTIVE: list[Optional["RowAttention"]] = [None]


@torch.library.custom_op("headway::row_attention", mutates_args=())
def _row_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    plan = _ACTIVE[0]
    if plan is None:
        raise RuntimeError("internal: a compiled row-exact step ran without its RowAttention plan")
    return _row_attention(q, k_cache, v_cache, plan, scale)


@_row_attention_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class RowAttention:
    """Attention that gives each query row exactly what a one-token decoding step of that token would: row i
    attends to the cache's first `start` slots and then `tails[i]` (its ancestors and itself, by depth), as a
    sequence of its own, with no mask. In bf16 the fused attention kernel's result for a row depends on the
    query count, the mask and the key length; after bf16 rounding that flips near-ties, so speculative and
    plain decoding part ways.

    Two implementations, one per runner (never mixed within a decode): `kernel`, Headway's C++ kernel
    (csrc/row_attention.cpp), whose every row's arithmetic is fixed whatever the other rows, so a tree costs
    about its rows' share of one pass over the cache; or (kernel None) SDPA per row: a row whose slots are the
    cache's first ones in order (plain decoding's row, every row of a chain) reads the cache in place, the
    others are gathered, rows of one length in one call. Either way the row's computation is
    plain decoding's."""

    def __init__(
        self,
        start: int,
        tails: list[list[int]],
        device: torch.device,
        kernel: Optional[Any] = None,
        transposed: Optional[TransposedKeys] = None,
    ):
        self.start, self.kernel = start, kernel
        # the kernel's transposed key blocks (None: it transposes the prefix afresh) and how many slots
        # are current
        self.transposed = transposed
        self.kt_valid = 0 if transposed is None else transposed.valid
        if kernel is not None:
            # rows past the first that repeat it (a one-token step's padding) are copies: computed once
            real = len(tails)
            while real > 1 and tails[real - 1] == tails[0]:
                real -= 1
            width = max(len(t) for t in tails[:real])
            self.tails = torch.tensor([t + [0] * (width - len(t)) for t in tails[:real]], device=device)
            self.lens = torch.tensor([len(t) for t in tails[:real]], device=device)
            self.order, self.in_order, self.groups, self.slots = torch.empty(0), True, [], None
            return
        self.tails = self.lens = torch.empty(0)
        in_place: list[int] = []
        by_len: dict[int, list[int]] = {}
        for i, tail in enumerate(tails):
            if tail == list(range(start, start + len(tail))):
                in_place.append(i)
            else:
                by_len.setdefault(len(tail), []).append(i)
        # groups in order: each in-place row alone, then each length's gathered rows, their slots gathered in
        # one call
        order = in_place + [i for rows in by_len.values() for i in rows]
        self.order = torch.tensor(order, device=device)
        self.in_order = order == list(range(len(order)))
        self.groups = [(1, start + len(tails[i]), True) for i in in_place] + [
            (len(rows), start + length, False) for length, rows in by_len.items()
        ]
        self.slots = None
        if by_len:  # tensor ops, not Python lists: the plan's cost must not grow with the sequence
            prefix = torch.arange(start, device=device)
            self.slots = torch.cat(
                [
                    torch.cat(
                        (
                            prefix.expand(len(rows), start),
                            torch.tensor([tails[i] for i in rows], device=device),
                        ),
                        dim=1,
                    ).view(-1)
                    for rows in by_len.values()
                ]
            )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [n, heads, head_dim] (rotated) -> [n, heads * head_dim], in q's dtype."""
        if torch.compiler.is_compiling():  # the plan is _ACTIVE's at run time (StaticRunner._row_exact)
            return torch.ops.headway.row_attention(q, k_cache, v_cache, scale)
        return _row_attention(q, k_cache, v_cache, self, scale)


class StaticLayerCache:
    """The EAGLE drafter's KV cache: one decoder layer's keys and values in a preallocated buffer that doubles
    when full. Passed as the `cache` of an EAGLE head's forward, it runs the layer itself (`run`), so drafting
    skips transformers' cache and mask machinery; `truncate` drops the expansion entries after a draft. Where
    the C++ layer loop covers the layer (`loop`: the target's target.layer_loop), the layer runs there as one
    call, with the fused element-wise kernels for bf16 rows when `fused` (the target's target.fused_ops): a
    draft step makes a few calls instead of about sixty small ones, whose Python cost matched the kernels'."""

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
        # rotary tables by position, extended as positions grow: the same values rotary_emb gives per call
        # (each is a function of its position alone), where the rotary does not rescale with the length
        # (dynamic types)
        self.rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.rope_by_position = "dynamic" not in str(getattr(self.rotary, "rope_type", "default"))
        self.loop, self.emb_norm = self._build_loop(layer, decoder, loop, p.device.type)
        self.fused = fused and p.dtype == torch.bfloat16

    def _build_loop(self, layer: Any, decoder: Any, mode: str, device: str) -> tuple[Optional[Any], Any]:
        """The C++ loop over this one layer (EAGLE-3's fused input norm: its hidden half as the layer's norm,
        its embedding half passed per call) and that embedding norm; (None, None) where the Python
        step runs."""
        norm = layer.input_layernorm
        split = getattr(norm, "hidden_norm", None), getattr(norm, "emb_norm", None)
        if device != "cpu" or not all(_lean_norm(n) for n in split):
            return None, None
        plan = LayerPlan(layer, lean=True)
        plan.norm1 = _rms_norm_fn(split[0], lean=True)
        # the loop's final norm is unused (`draft` returns the layer's raw output); any RMSNorm of the
        # width serves
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

    def _rope_tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` at these positions [1, n]."""
        if not self.rope_by_position:
            return rope_tables(*self.rotary(x, position_ids))
        top = int(position_ids.max()) + 1
        if self.rope is None or self.rope[0].shape[0] < top or self.rope[0].dtype != x.dtype:
            size = max(top, 2 * (0 if self.rope is None else self.rope[0].shape[0]), self.k.shape[1])
            every = torch.arange(size, device=x.device).unsqueeze(0)
            self.rope = rope_tables(*self.rotary(x, every))
        return self.rope[0][position_ids[0]], self.rope[1][position_ids[0]]

    def run(
        self, decoder: Any, x: torch.Tensor, position_ids: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The layer over x [1, n, h] at the next n slots; `mask` [1, 1, n, length + n] as the drafter
        builds it."""
        if x.shape[0] != 1:
            raise HeadwayError("internal: the drafter's static cache decodes one sequence at a time")
        start, n = self.length, x.shape[1]
        if start + n > self.k.shape[1]:
            grow = max(2 * self.k.shape[1], start + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(self.kv_heads, grow, self.head_dim)
                new[:, :start] = old[:, :start]
                setattr(self, name, new)
        cos, sin = self._rope_tables(x, position_ids)
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


def _lean_norm(norm: Any) -> bool:
    """Whether `norm` is an RMSNorm the C++ loop runs (a weight and a variance_epsilon)."""
    return getattr(norm, "weight", None) is not None and getattr(norm, "variance_epsilon", None) is not None


class LazyLogits:
    """The target's logits, a row at a time as they are read: a greedy tree walk reads only the root and the
    accepted nodes, plain decoding and the prefill only the last position. `row` maps hidden rows [k, H] to
    their logits [k, V] (see `StaticRunner._lm_row_fn`); `together(i)`, where given, names the rows to compute
    with row i in one call (row i first): where a few rows cost what one does, the nodes a walk may read next
    come free."""

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
    """together(i) for LazyLogits: node i and the first nodes below it, breadth first in rank order (its best
    children, or the next nodes of a chain), `count` in all."""

    def together(i: int) -> list[int]:
        out, j = [i], 0
        while j < len(out) and len(out) < count:
            out.extend(tree.children[out[j]][: count - len(out)])
            j += 1
        return out

    return together


class TransposedKeys:
    """The row attention kernel's copy of each layer's key cache in blocks of 16 keys, transposed (per layer
    [kv_heads, ceil(max_len / 16), head_dim rounded up to 4, 16], float32), and how many leading slots it
    holds current (`valid`). The kernel fills in the blocks it transposes, so a one-token step transposes only
    the newest block, not the whole prefix; every write to a key slot below `valid` (`written`) makes
    the blocks
    from there
    on stale."""

    def __init__(self, keys: list[torch.Tensor]):
        kv_heads, max_len, head_dim = keys[0].shape
        shape = (kv_heads, -(-max_len // 16), -(-head_dim // 4) * 4, 16)
        self.buffers = [torch.zeros(shape, dtype=torch.float32, device=k.device) for k in keys]
        self.keys = keys
        self._by_keys = {k.data_ptr(): b for k, b in zip(keys, self.buffers)}
        self.valid = 0

    def of(self, k_cache: torch.Tensor) -> torch.Tensor:
        """The transposed blocks of this layer's key cache."""
        return self._by_keys[k_cache.data_ptr()]

    def written(self, slot: int) -> None:
        """Key slots from `slot` on are (re)written."""
        self.valid = min(self.valid, slot)


class ModelEngine:
    """What the static engine keeps for one target model across sequences: its decoder layers as LayerPlans,
    its compiled decoder stack, its lm_head transposed (float32 CPUs) and the KV buffers (one pair per layer)
    that each new runner of the model reuses, grown when too small. The model owns it (`ModelEngine.of`), as
    gpt-fast's model owns its KV cache, so it lives and goes with the model."""

    ATTRIBUTE = "_headway_engine"

    def __init__(self) -> None:
        self._plans: dict[bool, list[LayerPlan]] = {}
        self._compiled: Any = None
        self._lm_t: Optional[torch.Tensor] = None
        self._kv: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
        self._kt: Optional[TransposedKeys] = None
        self._loops: dict[str, Any] = {}

    @classmethod
    def of(cls, model: Any) -> "ModelEngine":
        """The model's engine state, made on first use (not a submodule: never in its state_dict)."""
        engine = model.__dict__.get(cls.ATTRIBUTE)
        if engine is None:
            engine = cls()
            object.__setattr__(model, cls.ATTRIBUTE, engine)
        return engine

    def layer_plans(self, model: Any, lean: bool) -> list[LayerPlan]:
        """The model's decoder layers as LayerPlans, once per kind."""
        if lean not in self._plans:
            self._plans[lean] = [LayerPlan(layer, lean) for layer in model.model.layers]
        return self._plans[lean]

    def compiled_stack(self) -> Any:
        """`decoder_stack` under torch.compile, once per model. Shapes are dynamic: one graph serves every
        tree size, prompt length and cache length, and torch's 0/1 specialisation adds one for single tokens;
        two graphs in all, so no tree-size buckets or padding are needed. The first two calls compile (minutes
        for the default target on one CPU core); torch keeps the result in its on-disk cache, so later
        runs start
        in seconds."""
        if self._compiled is None:
            # freezing: the target's weights are constants of the graph, so inductor prepacks them for the
            # CPU's GEMM kernels (oneDNN/MKL).
            compiled = torch.compile(decoder_stack, dynamic=True, options={"freezing": True})

            def run(*args: Any) -> Any:
                # no duck sizing: sizes equal by chance when a graph compiles (a tree's 3 rows and the
                # target's 3 key/value heads) would be tied by a guard, and the next step would compile
                # another graph
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return compiled(*args)

            self._compiled = run
        return self._compiled

    def layer_loop(self, model: Any, mode: str) -> Any:
        """The C++ layer loop over the model's lean LayerPlans (`layer_loop.build_loop`), once per mode; None
        where the Python loop runs."""
        if mode not in self._loops:
            plans = self.layer_plans(model, lean=True)
            self._loops[mode] = layer_loop.build_loop(plans, model.model.norm, mode)
        return self._loops[mode]

    def lm_head_t(self, weight: torch.Tensor) -> torch.Tensor:
        """The lm_head weight [V, H] transposed to [H, V], contiguous, kept while its dtype holds."""
        if self._lm_t is None or self._lm_t.dtype != weight.dtype:
            self._lm_t = weight.t().contiguous()
        return self._lm_t

    def kv_buffers(
        self, layers: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values per layer, each [kv_heads, max_len, head_dim]: the kept ones when they are long
        enough and of this dtype and device (a runner starts empty by its length, not by clearing them)."""
        kv = self._kv
        if kv is None or kv[0][0].shape[1] < shape[1] or kv[0][0].dtype != dtype or kv[0][0].device != device:
            kv = tuple([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)] for _ in "kv")
            self._kv = kv
        return kv

    def transposed_keys(self, keys: list[torch.Tensor]) -> TransposedKeys:
        """The row attention kernel's transposed copy of these key buffers, shared by every runner of them."""
        if self._kt is None or self._kt.keys is not keys:
            self._kt = TransposedKeys(keys)
        return self._kt


class StaticRunner:
    """A preallocated KV cache (per layer [kv_heads, max_len, head_dim]) and Headway's own attention; with
    `compiled`, the decoder stack runs under torch.compile. `loop`, `row_attention`, `fused_ops`,
    `prompt_attention`: None takes the model's target.layer_loop, target.row_attention, target.fused_ops
    and target.prompt_attention."""

    def __init__(
        self,
        model: Any,
        max_len: int,
        compiled: bool = False,
        loop: Optional[str] = None,
        row_attention: Optional[str] = None,
        fused_ops: Optional[bool] = None,
        prompt_attention: Optional[str] = None,
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
        state = ModelEngine.of(model)
        self._stack = state.compiled_stack() if compiled else decoder_stack
        # eager steps: the decoder layers in one C++ call where it builds and covers them (same bits)
        # (loop: auto, cpp or python; None = the model's target.layer_loop)
        if compiled or self.device.type != "cpu":
            self._loop = None
        else:
            self._loop = state.layer_loop(model, loop or layer_loop.loop_mode(model))
        # bf16/fp16 on CPUs: decoding steps compute every row as a one-token step would (`_row_exact`);
        # compiled, a single token pads to 2 rows too, so that every step runs the one graph of dynamic
        # row count
        self.row_exact = _row_exact_dtype(self.dtype, self.device)
        # (row_attention: auto, cpp or sdpa; None = the model's target.row_attention)
        self.row_kernel = (
            layer_loop.row_kernel(row_attention or layer_loop.row_attention_mode(model))
            if self.row_exact
            else None
        )
        self.fewest_rows = max(fewest_rows(model), 2 if compiled else 1)
        self.lm_rows_free = rows_for_one(model)
        self.plans = state.layer_plans(model, lean=True)
        self.compiled_plans = state.layer_plans(model, lean=False) if compiled else None
        # row-exact: keys and values kept in float32 (exactly the bf16/fp16 values), the dtype a row's
        # attention runs in; a prompt's many rows attend in bf16 where the CPU has native bf16 kernels (AMX's
        # run a 1,000-token prompt's attention ~2.5x faster than float32's). Plain and speculative decoding
        # share the prompt.
        cache_dtype = torch.float32 if self.row_exact else self.dtype
        self.prompt_attn_dtype = (
            torch.bfloat16
            if self.row_exact and self.dtype == torch.bfloat16 and native_bf16(self.device)
            else None
        )
        kv = state.kv_buffers(
            len(self.layers), (self.kv_heads, max_len, self.head_dim), cache_dtype, self.device
        )
        self.k, self.v = kv
        self.kt = state.transposed_keys(self.k) if self.row_kernel is not None else None
        # bf16 and float32 steps through the C++ loop's fused element-wise kernels (fused_ops: None = the
        # model's target.fused_ops)
        if fused_ops is None:
            fused_ops = bool(getattr(model, "headway_fused_ops", True))
        self.fused_ops = (
            fused_ops and self._loop is not None and self.dtype in (torch.bfloat16, torch.float32)
        )
        # a fresh prompt's attention in the C++ loop: Headway's kernel, on bf16 brgemm in the fused loop where
        # the CPU has it (AMX), else there on float32 brgemm over the bf16 values where the CPU has AVX-512
        # (AVX512-BF16), and for float32 targets on float32 brgemm where the CPU has AVX-512
        mode = prompt_attention or getattr(model, "headway_prompt_attention", "auto")
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
        # a prompt at the cache's start: the attention kernel's causal path, cheaper than a dense mask
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
        # Compiled: the two graphs are one token and a tree. A prompt (a chain of many tokens, once per
        # sequence) runs eagerly, and the graphs always give the hidden states (free inside them) rather than
        # compiling twice.
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
    ) -> tuple[torch.Tensor, list]:
        """`decoder_stack` over x [1, n, hidden]: under torch.compile (`compiled`; its graphs always give the
        hidden states, and read `attend` from _ACTIVE), else in the C++ layer loop where there is one, else
        in Python."""
        args = (x, cos, sin, self.k, self.v, slots, end, mask)
        if compiled:
            _ACTIVE[0] = attend
            try:
                return self._stack(self.compiled_plans, self.base.norm, *args, True, attend)
            finally:
                _ACTIVE[0] = None
        if self._loop is None:
            return decoder_stack(self.plans, self.base.norm, *args, hidden, attend, causal, attn_dtype)
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
        """A decoding step (one token, or a tree) whose every row is bit-identical to a one-token step of that
        row's token after its accepted ancestors, so that greedy speculative decoding equals plain decoding in
        bf16 too. Two things differ with the row count in bf16 on CPUs: a linear over one row (it takes
        another kernel than 2 or more rows, which agree with each other), and fused attention (see
        RowAttention). So a single token runs as two or more identical rows (`fewest_rows`), and attention
        runs per row over exactly the slots it sees. The prompt runs normally: plain and speculative decoding
        share it."""
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
        # a step of fewer rows than the format's `fewest_rows` pads with copies of its first: the same token,
        # written to the same slot
        rows = max(n, self.fewest_rows)
        pick = torch.cat([torch.arange(n), torch.zeros(rows - n, dtype=torch.long)]).to(self.device)
        slots = start + pick
        positions = start + torch.tensor(depth, device=self.device)[pick]
        x = self.base.embed_tokens(ids[pick]).view(1, rows, -1)
        cos, sin = self.base.rotary_emb(x, positions.view(1, -1))
        attend = RowAttention(start, [tails[i] for i in pick.tolist()], self.device, self.row_kernel, self.kt)
        x, states = self._run_stack(
            x, cos, sin, slots, start + n, None, hidden, attend, compiled=self.compiled
        )
        if self.kt is not None:  # every layer's kernel filled in the complete blocks below start
            self.kt.valid = start // 16 * 16
        self.length = start + n
        x, states = x[:, :n], [h[:, :n] for h in states]
        return self._logits(x[0], tree), tuple(states) if hidden else None

    def _lm_row_fn(self, model: Any) -> Any:
        """One row of logits: the model's own lm_head where its weights are packed (float16), else a [1, H] x
        [H, V] product against the pre-transposed weight in float32/64 on CPUs (much faster there than a
        linear), else a plain one-row linear (bf16 on CPUs, GPUs)."""
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
        # a path that is the tree's first nodes in order (the root alone, the head of a chain) is already
        # in place
        if keep != list(range(len(keep))):
            src = torch.tensor(keep, device=self.device) + first
            for cache in (*self.k, *self.v):
                cache[:, first : first + len(keep)] = cache.index_select(1, src)
        self.length = first + len(keep)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def engine_name(model: Any, engine: str = "auto") -> str:
    """The engine `engine` means for this model: auto is static where supported, else hf."""
    if engine in ("static", "compiled") and not static_supported(model):
        family = getattr(text_config(model.config), "model_type", "?")
        raise HeadwayError(
            f"inference.engine={engine} supports {', '.join(STATIC_FAMILIES)} with full attention, not "
            f"this '{family}' target: use inference.engine=auto or hf"
        )
    if engine == "auto":
        return "static" if static_supported(model) else "hf"
    return engine


def _row_exact_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"


def depth_matters(model: Any, engine: str = "auto") -> bool:
    """Whether a verification's cost depends on its tree's depth, not only its size: the row-exact engines
    (static and compiled, bf16/fp16 on CPUs) run one attention call per depth level (RowAttention)."""
    p = next(model.parameters())
    return engine_name(model, engine) in ("static", "compiled") and _row_exact_dtype(p.dtype, p.device)


def make_runner(model: Any, max_len: int, engine: str = "auto") -> Any:
    """A fresh runner (empty cache) for sequences of up to `max_len` tokens.

    Args:
        model: the target; engine: auto (static where the family supports it, else hf), static, compiled, hf.
    Returns:
        A `Runner`: forward(ids [n], tree=None, hidden=False) -> (logits [n, V], hidden states), keep(),
        truncate(). Static runners of one model share its KV buffers (`ModelEngine`): one sequence at
        a time."""
    name = engine_name(model, engine)
    if name == "hf":
        return HFRunner(model)
    return StaticRunner(model, max_len, compiled=name == "compiled")

"""The shared step math of the static engines: one Llama-style decoder layer over rows
(`layer_step`), the decoder stack (`decoder_stack`), and the layer's parts as plain callables
(`LayerPlan`). Device-agnostic: the CPU backend (engines/static/runner.py) and the CUDA backend
(engines/cuda/runner.py) run the same arithmetic; only the KV cache, the attention and the dispatch
differ between them.

The families (STATIC_FAMILIES): Llama (every rope type whose tables are a function of the position:
default, linear, llama3, yarn), Qwen2, Mistral without a sliding window, Qwen3 (an RMSNorm over each
query and key head before the rotary), SmolLM3 (layers without rotary: NoPE), and the MoE families
Qwen3-MoE and Mixtral (their sparse blocks routed row by row: `MoeRows`; the CPU backend only).
Gemma-3 runs on the CUDA backend through `gemma3_layer_step`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from headway.errors import HeadwayError
from headway.target.packed_formats import row_linear
from headway.target.packed_fusion import fused_projections

# the families whose layers `layer_step` runs (llama-style, full attention; q/k norms, NoPE layers
# and MoE blocks where the family has them)
STATIC_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "smollm3", "qwen3_moe", "mixtral")


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary cos/sin [1, n, head_dim] as `layer_step` takes them: [n, 1, head_dim]
    (over every head), sin with its first half negated, so that rotating x is x * cos + (x's halves
    swapped) * sin: the same products as transformers' rotate_half, each rounded the same, with two
    ops fewer."""
    half = sin.shape[-1] // 2
    return cos[0, :, None], torch.cat((-sin[0, :, None, :half], sin[0, :, None, half:]), dim=-1)


class LeanRMSNorm:
    """An RMSNorm as a plain callable, in transformers' own arithmetic for the static families (a
    `weight` and a `variance_epsilon`), without the module's dispatch; its weight and eps are what
    the C++ layer loop reads."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


def _rms_norm_fn(norm: Any, lean: bool) -> Any:
    """The layer's RMSNorm as a `LeanRMSNorm` (lean), else the module."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not lean or weight is None or eps is None:
        return norm
    return LeanRMSNorm(weight, eps)


class MoeRows:
    """A sparse MoE block (Qwen3-MoE's, Mixtral's: a top-k router and experts as 3-D weights) over
    rows [n, hidden], routed and computed row by row: each row's router and experts run as one-row
    products of the same shapes whatever the other rows are, so a tree's row gets exactly the bits a
    one-token step gives it, in every dtype (grouping a step's rows by expert would give a row the
    bits of a product over however many rows chose that expert). A prompt's rows, which no tree step
    has to reproduce, run through the block itself (`grouped`).

    The router is the model's own module (its softmax, top-k and renormalisation, in the family's
    dtypes); the experts are computed as transformers' eager experts compute them (gate_up,
    act(gate) * up, down, times the routing weight, summed in the row's dtype by ascending expert),
    where their weights have that layout, else by the experts module over the one row."""

    def __init__(self, block: Any):
        self.block, self.router, experts = block, block.gate, block.experts
        self.gate_up = getattr(experts, "gate_up_proj", None)
        self.down = getattr(experts, "down_proj", None)
        self.act = getattr(experts, "act_fn", None)
        # the eager layout: gate and up concatenated, [experts, out, in], no biases, the default
        # gating
        plain = (
            getattr(experts, "has_gate", True)
            and getattr(experts, "is_concatenated", True)
            and not getattr(experts, "is_transposed", False)
            and not getattr(experts, "has_bias", False)
            and not getattr(experts, "has_post_expert_norm", False)
            and getattr(type(experts), "_apply_gate", None) in (None, _transformers_gate())
        )
        self.fast = (
            plain
            and self.act is not None
            and all(w is not None and w.dim() == 3 for w in (self.gate_up, self.down))
        )
        self.experts = experts

    def __call__(self, h: torch.Tensor, grouped: bool = False) -> torch.Tensor:
        n, width = h.shape
        if grouped:
            return self.block(h.view(1, n, width)).view(n, width)
        out = []
        for r in range(n):
            row = h[r : r + 1]
            _, weights, index = self.router(row)
            if not self.fast:
                out.append(self.experts(row, index, weights).to(h.dtype))
                continue
            acc = None
            # ascending expert order, each contribution rounded to the row's dtype before it is
            # added, as the eager experts' index_add_ does
            for j in sorted(range(index.shape[-1]), key=lambda j: int(index[0, j])):
                e = int(index[0, j])
                gate, up = F.linear(row, self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(self.act(gate) * up, self.down[e])
                y = (y * weights[0, j, None]).to(h.dtype)
                acc = y if acc is None else acc + y
            out.append(acc)
        return torch.cat(out)


def _transformers_gate() -> Any:
    """transformers' default gating of fused experts (act(gate) * up), where this transformers has
    it."""
    try:
        from transformers.integrations.moe import _default_apply_gate as gate
    except ImportError:  # an older transformers: its experts gate that way
        return None
    return gate


def moe_block(mlp: Any) -> bool:
    """Whether a decoder layer's `mlp` is a sparse MoE block `MoeRows` runs (a router `gate` and an
    `experts` module)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and not hasattr(mlp, "down_proj")


class LayerPlan:
    """One Llama-style decoder layer as `layer_step` runs it: its norms, projections and MLP as
    callables over rows [n, hidden], its attention's sizes, and what its family adds: an RMSNorm
    over each query and key head before the rotary (Qwen3: `q_norm`, `k_norm`), no rotary at all
    (SmolLM3's NoPE layers: `rope` False), a sparse MoE block instead of the MLP (`moe`). Lean
    (eager decoding), the callables skip nn.Module dispatch and call the weights' kernels directly
    (`row_linear`); else (under torch.compile, which traces them) they are the modules."""

    def __init__(self, layer: Any, lean: bool):
        a, mlp = layer.self_attn, layer.mlp
        cfg = a.config
        self.head_dim = int(a.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.scaling = float(a.scaling)
        self.norm1 = _rms_norm_fn(layer.input_layernorm, lean)
        self.norm2 = _rms_norm_fn(layer.post_attention_layernorm, lean)
        # Qwen3's per-head norms (over head_dim: a norm over the whole projection, as OLMo-2's, is
        # not this)
        self.q_norm = self.k_norm = None
        if getattr(a, "q_norm", None) is not None:
            for norm in (a.q_norm, a.k_norm):
                if getattr(norm, "weight", None) is None or norm.weight.shape[-1] != self.head_dim:
                    raise HeadwayError(
                        f"the static engine's q/k norms are per head (width {self.head_dim}); this "
                        f"{type(a).__name__} normalises another width: use inference.engine=hf"
                    )
            self.q_norm, self.k_norm = _rms_norm_fn(a.q_norm, lean), _rms_norm_fn(a.k_norm, lean)
        # SmolLM3: a layer without rotary embedding (use_rope 0)
        self.rope = bool(getattr(a, "use_rope", True))
        fn = row_linear if lean else (lambda m: m)
        qkv = fused_projections(a, "headway_qkv")
        if qkv is not None:
            self.qkv = fn(qkv.linear)
        else:
            q, k, v = fn(a.q_proj), fn(a.k_proj), fn(a.v_proj)
            self.qkv = lambda h: torch.cat((q(h), k(h), v(h)), dim=-1)
        self.o = fn(a.o_proj)
        self.mlp = mlp
        self.moe = MoeRows(mlp) if moe_block(mlp) else None
        gate_up = None if self.moe else fused_projections(mlp, "headway_gate_up")
        self.gate_up = None if gate_up is None else fn(gate_up.linear)
        self.down = None if self.moe else fn(mlp.down_proj)
        self.act = None if self.moe else mlp.act_fn
        self.inter = 0 if gate_up is None else gate_up.sizes[0]
        # the modules behind qkv (one fused or three), o, gate_up (one fused or gate and up) and
        # down, for the C++ layer loop (an MoE layer's MLP part: none)
        self.linears = (
            [qkv.linear] if qkv is not None else [a.q_proj, a.k_proj, a.v_proj],
            a.o_proj,
            []
            if self.moe
            else [gate_up.linear]
            if gate_up is not None
            else [mlp.gate_proj, mlp.up_proj],
            None if self.moe else mlp.down_proj,
        )


def gqa_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    fold: Optional[bool] = None,
) -> torch.Tensor:
    """SDPA of q [B, heads, n, hd] over k, v [B, kv_heads, L, hd] (grouped-query: query head h reads
    key-value head h // group) under `mask` (bool or additive, broadcastable to [B, 1, n, L]) or
    `causal`.

    With a mask and grouped heads, SDPA's flash and memory-efficient kernels refuse the call (flash
    takes no mask; the memory-efficient kernel's dense path no GQA) and torch falls to the math
    kernel, which repeats K/V for every query head and materialises fp32 scores. `fold` (default: on
    CUDA) folds each key-value head's query group into the query axis instead: q [B, kv, group * n,
    hd] beside K/V as they are, the mask repeated per group, so the head counts match and the
    memory-efficient kernel takes the mask. Each query row still attends to the same keys under the
    same mask (the same result up to the kernel's rounding). On CPUs the call is left as it was (the
    CPU engine's bits are its own contract)."""
    heads, kv = q.shape[1], k.shape[1]
    fold = q.is_cuda if fold is None else fold
    m = mask
    if m is not None and fold and heads != kv:
        while m.dim() < 4:
            m = m[None]
        if m.shape[1] == 1:
            b, n, hd, group = q.shape[0], q.shape[2], q.shape[3], heads // kv
            m = m.expand(m.shape[0], 1, n, m.shape[-1])
            m = (
                m[:, :, None]
                .expand(m.shape[0], 1, group, n, m.shape[-1])
                .reshape(m.shape[0], 1, group * n, -1)
            )
            o = F.scaled_dot_product_attention(
                q.reshape(b, kv, group * n, hd), k, v, attn_mask=m, scale=scale
            )
            return o.view(b, kv, group, n, hd).reshape(b, heads, n, hd)
    # (enable_gqa=True also serves equal head counts; `heads != kv` is a SymBool under dynamic
    # shapes, which SDPA refuses, breaking the compiled engine's graph)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
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
    attend: Optional[Any] = None,
    causal: bool = False,
    attn_dtype: Optional[torch.dtype] = None,
    grouped: bool = False,
) -> torch.Tensor:
    """One Llama-style decoder layer over rows x [n, hidden]: its keys and values go into cache
    slots `slots` [n] of k_cache/v_cache [kv_heads, max_len, head_dim] (in place, in the cache's
    dtype), and its queries attend to slots [0, end) under `mask` (bool or additive, [n, end] or
    broadcastable; None: every slot), or by `attend`; `causal` (a prompt at the cache's start, no
    mask): row i sees slots [0, i], through the kernel's causal path. `attn_dtype`: the dtype that
    attention (not `attend`) runs in; None: the cache's. cos/sin: `rope_tables` (unused by a NoPE
    layer). `grouped`: rows that no tree step has to reproduce (a prompt), which an MoE block may
    then group by expert (`MoeRows`). The layer's own weights do the projections, norms and MLP;
    only the cache and the attention are Headway's. (index_copy_ at a slot tensor, not a slice
    assignment at a Python offset: torch.compile then updates the cache in place.)"""
    n, hd, heads, kv = x.shape[0], plan.head_dim, plan.heads, plan.kv_heads
    qkv = plan.qkv(plan.norm1(x))
    # the queries' and keys' heads rotate together: [n, heads + kv_heads, head_dim]
    qk = qkv[:, : (heads + kv) * hd].view(n, heads + kv, hd)
    if plan.q_norm is not None:  # each head normed before the rotary, as Qwen3's attention does
        qk = torch.cat((plan.q_norm(qk[:, :heads]), plan.k_norm(qk[:, heads:])), dim=1)
    if plan.rope:
        qk = qk * cos + qk.view(n, heads + kv, 2, hd // 2).flip(2).view(n, heads + kv, hd) * sin
    q, k = qk[:, :heads], qk[:, heads:]
    v = qkv[:, (heads + kv) * hd :].view(n, kv, hd)
    k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
    if attend is None:
        adt = attn_dtype or k_cache.dtype
        o = gqa_sdpa(
            q.transpose(0, 1)[None].to(adt),
            k_cache[None, :, :end].to(adt),
            v_cache[None, :, :end].to(adt),
            mask,
            causal,
            plan.scaling,
        )
        o = o[0].transpose(0, 1).reshape(n, -1).to(x.dtype)
    else:
        o = attend(q, k_cache, v_cache, plan.scaling)
    x = x + plan.o(o)
    h = plan.norm2(x)
    if plan.moe is not None:
        return x + plan.moe(h, grouped)
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
    attend: Optional[Any] = None,
    causal: bool = False,
    attn_dtype: Optional[torch.dtype] = None,
    grouped: bool = False,
) -> tuple[torch.Tensor, list]:
    """Every decoder layer (`layer_step`, plans[i] on caches ks[i]/vs[i]) over x [1, n, hidden] and
    the final
    norm: the normed output [1, n, hidden] and, with `hidden`, the hidden states as transformers'
    output_hidden_states gives them (the last one normed). cos/sin: the model's rotary embedding [1,
    n, head_dim]; `grouped`: see `layer_step`. The unit `inference.engine=compiled` hands to
    torch.compile."""
    cos, sin = rope_tables(cos, sin)
    x = x[0]
    states = [x] if hidden else []
    for plan, k, v in zip(plans, ks, vs):
        x = layer_step(
            plan, x, cos, sin, k, v, slots, end, mask, attend, causal, attn_dtype, grouped
        )
        if hidden:
            states.append(x)
    x = norm(x)
    if hidden:
        states[-1] = x
    return x[None], [h[None] for h in states]


def _lean_norm(norm: Any) -> bool:
    """Whether `norm` is an RMSNorm the C++ loop runs (a weight and a variance_epsilon)."""
    return (
        getattr(norm, "weight", None) is not None
        and getattr(norm, "variance_epsilon", None) is not None
    )


# the families the CUDA backend runs besides the static ones: their layers through
# `gemma3_layer_step`
GEMMA3_FAMILIES = ("gemma3_text", "gemma3")


def gemma3_layer_step(
    layer: Any,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    end: int,
    mask: Optional[torch.Tensor],
    causal: bool = False,
    attend: Optional[Any] = None,
) -> torch.Tensor:
    """One Gemma-3 decoder layer over rows x [n, hidden], in `layer_step`'s contract (cache slots,
    attention over slots [0, end) under `mask`, or `causal`, or by `attend`): the layer's own
    modules do the projections, the q/k norms, the four RMSNorms (1 + weight, in float32) and the
    GeLU MLP; the cache and the attention are Headway's. The caller passes the mask of the layer's
    kind (full, or sliding-window) and the rotary tables of its kind."""
    a = layer.self_attn
    n, hd = x.shape[0], int(a.head_dim)
    h = layer.input_layernorm(x)
    q = a.q_norm(a.q_proj(h).view(n, -1, hd))
    k = a.k_norm(a.k_proj(h).view(n, -1, hd))
    v = a.v_proj(h).view(n, -1, hd)
    heads = q.shape[1]
    qk = torch.cat((q, k), dim=1)
    qk = qk * cos + qk.view(n, qk.shape[1], 2, hd // 2).flip(2).view(n, qk.shape[1], hd) * sin
    q, k = qk[:, :heads], qk[:, heads:]
    k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
    if attend is not None:
        o = attend(q, k_cache, v_cache, float(a.scaling))
    else:
        o = gqa_sdpa(
            q.transpose(0, 1)[None],
            k_cache[None, :, :end],
            v_cache[None, :, :end],
            mask,
            causal,
            float(a.scaling),
        )
        o = o[0].transpose(0, 1).reshape(n, -1)
    o = a.o_proj(o.to(x.dtype))
    x = x + layer.post_attention_layernorm(o)
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))

"""The shared step math of the static engines: one Llama-style decoder layer over rows (`layer_step`), the
decoder stack (`decoder_stack`), and the layer's parts as plain callables (`LayerPlan`). Device-agnostic: the
CPU backend (engine_cpu.py) and the CUDA backend (engine_cuda.py) run the same arithmetic; only the KV cache,
the attention and the dispatch differ between them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from headway.target.packed_formats import row_linear
from headway.target.packed_fusion import fused_projections

# the families whose layers `layer_step` runs (llama-style, full attention)
STATIC_FAMILIES = ("llama", "qwen2", "mistral")


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
    attend: Optional[Any] = None,
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
    attend: Optional[Any] = None,
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


def _lean_norm(norm: Any) -> bool:
    """Whether `norm` is an RMSNorm the C++ loop runs (a weight and a variance_epsilon)."""
    return getattr(norm, "weight", None) is not None and getattr(norm, "variance_epsilon", None) is not None


# the families the CUDA backend runs besides the static ones: their layers through `gemma3_layer_step`
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
    """One Gemma-3 decoder layer over rows x [n, hidden], in `layer_step`'s contract (cache slots, attention
    over slots [0, end) under `mask`, or `causal`, or by `attend`): the layer's own modules do the
    projections, the q/k norms, the four RMSNorms (1 + weight, in float32) and the GeLU MLP; the cache and
    the attention are Headway's. The caller passes the mask of the layer's kind (full, or sliding-window)
    and the rotary tables of its kind."""
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
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k_cache[None, :, :end],
            v_cache[None, :, :end],
            attn_mask=mask,
            is_causal=causal,
            scale=float(a.scaling),
            enable_gqa=True,
        )
        o = o[0].transpose(0, 1).reshape(n, -1)
    o = a.o_proj(o.to(x.dtype))
    x = x + layer.post_attention_layernorm(o)
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))

"""DFlash: a block drafter that proposes `block_size - 1` tokens in one forward.

The block is the last accepted token followed by mask tokens, embedded with the target's frozen
embedding. Each of its decoder layers attends bidirectionally within the block and to the context:
the target's fused hidden states for every earlier position, projected by `fc`, normalised by
`hidden_norm` and turned into keys and values by the layer's own k/v projections (with per-head q/k
norms, as vLLM's and speculators' Qwen3-style DFlash layers). Slot j of the block predicts the token
j positions after the anchor. The read-out is the head's own lm_head over a reduced draft vocabulary
(d2t), cheap as in EAGLE-3, or (lm_head=target) the target's own frozen lm_head over its whole
vocabulary, the read-out SGLang's DFlash serves.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from headway.errors import HeadwayError
from headway.heads.config import DFlashConfig
from headway.heads.eagle3 import fused_layers


def mask_token(configured: int, vocab_size: int) -> int:
    """The mask slots' token id: the configured one, or (-1) the target's last vocabulary id."""
    return configured if configured >= 0 else vocab_size - 1


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (the rotate-half form transformers and vLLM's neox style use): x [B, heads, N, d],
    cos/sin [B, N, d]."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, self.heads, self.kv_heads = (
            c["hidden_size"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
        )
        self.head_dim = c["head_dim"]
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=c["rms_norm_eps"])
        self.k_norm = nn.RMSNorm(self.head_dim, eps=c["rms_norm_eps"])

    def kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x [B, N, h]: each [B, kv_heads, N, head_dim]."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, N, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        allowed: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """x [B, Q, h] (the block, normed); context keys/values [B, kv_heads, N, d]; allowed [B, Q,
        N + Q] or None (every query sees everything) -> [B, Q, h]."""
        B, Q, _ = x.shape
        q = rotate(
            self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2),
            cos,
            sin,
        )
        k_block, v_block = self.kv(x, cos, sin)
        k = torch.cat((context[0], k_block), dim=2)
        v = torch.cat((context[1], v_block), dim=2)
        if self.heads != self.kv_heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        mask = allowed.unsqueeze(1) if allowed is not None else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask
        )  # no causal mask: the block sees itself both ways
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(h, c["intermediate_size"], bias=False),
                "up_proj": nn.Linear(h, c["intermediate_size"], bias=False),
                "down_proj": nn.Linear(c["intermediate_size"], h, bias=False),
            }
        )

    def forward(
        self, x: torch.Tensor, cos: Any, sin: Any, context: Any, allowed: Any
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, allowed)
        m = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](m)) * self.mlp["up_proj"](m))


class DFlashHead(nn.Module):
    """The DFlash drafter: context features [.., k*h] in, logits over the draft vocabulary for each
    block slot."""

    kind = "dflash"

    def __init__(
        self,
        cfg: DFlashConfig,
        hidden_size: int,
        vocab_size: int,
        layer_config: dict,
        d2t: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.cfg, self.hidden_size, self.vocab_size = cfg, hidden_size, vocab_size
        self.layer_config = dict(layer_config)
        own = cfg.lm_head == "own"
        size = min(cfg.draft_vocab_size, vocab_size) if own else vocab_size
        # lm_head=target drafts over the whole vocabulary: d2t is the identity, rebuilt rather than
        # saved
        self.register_buffer(
            "d2t", d2t if d2t is not None and own else torch.arange(size), persistent=own
        )
        n_fused = len(cfg.feature_layers) or 3
        self.fc = nn.Linear(n_fused * hidden_size, hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=layer_config["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(layer_config) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(hidden_size, eps=layer_config["rms_norm_eps"])
        self.lm_head = nn.Linear(hidden_size, len(self.d2t), bias=False) if own else None
        self._target_lm_head: Optional[torch.Tensor] = None  # lm_head=target: set by attach_target
        rope_cfg = {k: v for k, v in layer_config.items() if k != "model_type"}
        # its inverse frequencies are not saved
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**rope_cfg))
        self._embed: Optional[torch.Tensor] = None

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    @property
    def mask_token_id(self) -> int:
        return mask_token(self.cfg.mask_token_id, self.vocab_size)

    @property
    def draft_depth(self) -> int:
        """Tokens one forward drafts: the block's mask slots."""
        return self.cfg.block_size - 1

    @staticmethod
    def feature_layers(cfg: DFlashConfig, num_target_layers: int) -> list[int]:
        """The fused target layers: cfg's, or the (2, L//2, L-3) default."""
        return fused_layers("head.dflash", list(cfg.feature_layers), num_target_layers)

    def attach_target(self, target_model: Any) -> None:
        """Share the target's embedding, and with lm_head=target its lm_head (frozen, never saved
        with the head)."""
        self._embed = target_model.get_input_embeddings().weight.detach()
        if self.lm_head is None:
            self._target_lm_head = target_model.get_output_embeddings().weight.detach()

    def init_from_target(self, target_model: Any) -> None:
        """Start the read-out where the target's is: its lm_head rows for the draft vocabulary, its
        final norm."""
        lm = target_model.get_output_embeddings().weight
        final_norm = getattr(getattr(target_model, "model", None), "norm", None)
        with torch.no_grad():
            if self.lm_head is not None:
                self.lm_head.weight.copy_(lm[self.d2t.to(lm.device)].to(self.lm_head.weight.dtype))
            if final_norm is not None and getattr(final_norm, "weight", None) is not None:
                self.norm.weight.copy_(final_norm.weight.to(self.norm.weight.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.d2t.to(draft_ids.device)[draft_ids]

    def rope_at(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, N, head_dim] at positions [B, N]."""
        return self.rotary(like, positions)

    def context(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values for context features [B, N, k*h] at positions [B, N]."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rope_at(positions, c)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    def block(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        allowed: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits [B, Q, draft vocab] of block tokens [B, Q] (anchors and mask ids) at positions [B,
        Q], attending to `context` (from `context`) and to each other where allowed [B, Q, N + Q]
        (None: everywhere)."""
        return self.read_out(self.block_states(tokens, positions, context, allowed))

    def block_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        allowed: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`block`'s normed states [B, Q, hidden], before the read-out (the training loss reads them
        in chunks)."""
        if self._embed is None:
            raise HeadwayError("a DFlash head needs attach_target(target model) first")
        x = F.embedding(tokens, self._embed).to(self.fc.weight.dtype)
        cos, sin = self.rope_at(positions, x)
        for layer, kv in zip(self.layers, context):
            x = layer(x, cos, sin, kv, allowed)
        return self.norm(x)

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [..., draft vocab] of normed block states x [..., hidden]: the head's lm_head, or
        the target's."""
        if self.lm_head is not None:
            return self.lm_head(x)
        weight = self.readout_weight
        if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            # a head decoding in another dtype than the target's: convert the shared weight once,
            # not per draft
            weight = self._target_lm_head = weight.to(x.dtype)
        return F.linear(x, weight)

    @property
    def readout_weight(self) -> torch.Tensor:
        """The read-out's weight [V, hidden]: the head's lm_head, or the target's (frozen)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if self._target_lm_head is None:
            raise HeadwayError(
                "a DFlash head with lm_head=target needs attach_target(target model) first"
            )
        return self._target_lm_head

    def draft_logits(self, context: list, root: int, position: int) -> torch.Tensor:
        """One drafting forward: the block [root, mask, ...] at `position` after the context ->
        [block_size - 1, draft vocab], slot j's logits for the token j positions after the root."""
        device = self.fc.weight.device
        tokens = torch.full((1, self.cfg.block_size), self.mask_token_id, device=device)
        tokens[0, 0] = root
        positions = position + torch.arange(self.cfg.block_size, device=device).view(1, -1)
        return self.block(tokens, positions, context)[0, 1:]

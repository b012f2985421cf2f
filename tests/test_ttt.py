"""Training-time test computes only the positions a loss reads: same loss, same gradients as the dense unroll."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from headway.heads.draft_layer import drafter_mask
from headway.run_config import RunConfig
from headway.train.losses import target_to_draft
from headway.train.objectives import Features, eagle3_objective
from headway.train.ttt import causal_allowed, kept_positions, shifted, ttt_unroll
from test_eagle import ARCHS, load64, random_head


def dense_eagle3_loss(heads, batch: dict, feats: Features, t2d: torch.Tensor) -> torch.Tensor:
    """The unroll as it was first written: every position at every step, one dense [T, (j+1) T] mask per step."""
    ec = heads.cfg
    ids, attn = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    base = causal_allowed(attn)
    eye = torch.eye(T, dtype=torch.bool).expand(B, T, T)
    cache = DynamicCache(config=heads.decoder.config)
    hidden = heads.project(feats.cat(ec.feature_layers))
    target_p = torch.softmax(feats.draft_logits(heads.d2t).float(), -1)
    in_draft = t2d[feats.argmax] >= 0
    total = target_p.new_zeros(())
    for j in range(ec.ttt_steps):
        allowed = torch.cat([base] + [eye] * j, dim=-1)
        pos = (torch.arange(T) + j).unsqueeze(0)
        out = heads(shifted(ids, 1 + j), hidden, pos, drafter_mask(allowed, heads.fc.weight.dtype), cache)
        hidden = heads.next_hidden(out)
        valid = shifted(batch["loss_mask"], 2 + j).bool() & shifted(in_draft, 1 + j, False)
        if valid.any():
            logits = heads.logits(out[valid]).float()
            p = shifted(target_p, 1 + j)[valid]
            total = total + ec.ttt_decay**j * -(p * F.log_softmax(logits, -1)).sum(-1).mean()
    return total


def padded_batch(t, seed: int = 3) -> tuple[dict, Features]:
    """Three rows of different lengths (right-padded), each a prompt then an answer, with random features."""
    torch.manual_seed(seed)
    B, T, V = 3, 16, t.config.vocab_size
    lengths, prompts = [16, 11, 7], [5, 6, 2]
    ids = torch.randint(0, V, (B, T))
    attn = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    for b, (n, p) in enumerate(zip(lengths, prompts)):
        attn[b, :n] = 1
        loss_mask[b, p:n] = 1
    L = t.config.num_hidden_layers
    hidden = {i: torch.randn(B, T, t.config.hidden_size, dtype=torch.float64) for i in range(L + 1)}
    logits = torch.randn(B, T, V, dtype=torch.float64) * 3
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}
    return batch, Features(hidden, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_unroll_gives_the_dense_loss_and_gradients(tiny_dirs, arch: str):
    t = load64(tiny_dirs[arch])
    heads = random_head(t, "eagle3").train()
    heads.cfg.ttt_steps = 4
    batch, feats = padded_batch(t)
    t2d = target_to_draft(heads.d2t, heads.vocab_size, torch.device("cpu"))

    def grads(loss_fn):
        heads.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in heads.named_parameters() if p.grad is not None}

    cfg = RunConfig()
    dense_loss, dense_grads = grads(lambda: dense_eagle3_loss(heads, batch, feats, t2d))
    sparse_loss, sparse_grads = grads(lambda: eagle3_objective(cfg, heads, batch, feats, t2d)[0])
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-10, atol=1e-12)
    assert dense_grads.keys() == sparse_grads.keys() and len(dense_grads) > 5
    for name, g in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)


def test_unroll_skips_positions_no_loss_reads(tiny_dirs):
    """With the prompt masked out, steps j >= 1 run on the answer's positions only (and pad the shorter row)."""
    t = load64(tiny_dirs["llama"])
    heads = random_head(t, "eagle3")
    batch, feats = padded_batch(t)
    needed = torch.zeros(3, 16, dtype=torch.bool)
    needed[0, 4:9] = True
    needed[2, 1:3] = True
    index, kept = kept_positions(needed)
    assert index.tolist() == [[4, 5, 6, 7, 8], [0, 0, 0, 0, 0], [1, 2, 0, 0, 0]]
    assert kept.sum(1).tolist() == [5, 0, 2]
    with torch.no_grad():
        hidden = heads.project(feats.cat(heads.cfg.feature_layers))
        sparse = ttt_unroll(heads, batch["input_ids"], batch["attention_mask"], hidden, 3, needed)
        full = ttt_unroll(heads, batch["input_ids"], batch["attention_mask"], hidden, 3)
    assert sparse.outputs[0].shape[1] == 16 and sparse.outputs[2].shape[1] == 5
    for j in (1, 2):
        torch.testing.assert_close(sparse.outputs[j][0], full.outputs[j][0, 4:9])
        torch.testing.assert_close(sparse.outputs[j][2, :2], full.outputs[j][2, 1:3])

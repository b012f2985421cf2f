"""The frozen target's forward on a packed batch given its sequences' bounds
(train/target_features.py `document_causal`, train/packing.py `doc_segments`).

Each packed sequence attends within itself by one causal SDPA call on its slice of the row: the
same hidden states as the dense document-causal mask [B, 1, T, T] the forward used to build (and
as each sequence's own forward), with no [T, T] mask built, the key-value heads not repeated, and
the padding attending nothing and seen by nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from headway.errors import HeadwayError
from headway.train.data import Sample
from headway.train.packing import collate_packed, doc_segments
from headway.train.target_features import target_features
from tests.helpers.tiny_models import make_tiny_model

T = 256  # the pack length
# row 0 ends in 26 tokens of padding, row 1 in 4; none longer than Gemma-3's 128-token window
LENGTHS = [[100, 90, 40], [128, 124]]


def _model(arch: str, root: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(arch, root / arch)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").to(dtype).eval()


def _batch(lengths: list[list[int]] = LENGTHS, length: int = T, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = [
        [Sample(torch.randint(3, 300, (n,), generator=g).tolist(), [1] * n) for n in row]
        for row in lengths
    ]
    return rows, collate_packed(rows, length, 0)


def _dense_mask(doc: torch.Tensor) -> torch.Tensor:
    """The forward's mask before: query t sees key s <= t of its own sequence, [B, 1, T, T]."""
    n = doc.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (causal & (doc.unsqueeze(-1) == doc.unsqueeze(1))).unsqueeze(1)


def _dense_forward(model: Any, batch: dict[str, torch.Tensor]) -> Any:
    """transformers' SDPA forward under the dense document-causal mask (a 4-D mask goes in as
    is)."""
    return model(
        input_ids=batch["input_ids"],
        attention_mask=_dense_mask(batch["doc"]),
        position_ids=batch["positions"],
        output_hidden_states=True,
        use_cache=False,
    )


def _real(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["doc"] >= 0


def _packed(model: Any, batch: dict[str, torch.Tensor], layers: list[int], logits: bool = True):
    """The packed forward as a training step runs it: the sequences' bounds read on the host."""
    return target_features(
        model,
        batch["input_ids"],
        layers,
        batch["positions"],
        batch["doc"],
        logits=logits,
        segments=doc_segments(batch["doc"]),
    )


@contextmanager
def _sdpa_calls() -> Iterator[list[dict[str, Any]]]:
    """Every `scaled_dot_product_attention` call inside the block: its query and key shapes, mask
    and flags."""
    calls: list[dict[str, Any]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def wrapped(query, key, value, attn_mask=None, **kwargs):
        calls.append(
            {
                "query": tuple(query.shape),
                "key": tuple(key.shape),
                "mask": attn_mask is not None,
                "is_causal": kwargs.get("is_causal", False),
                "gqa": kwargs.get("enable_gqa", False),
            }
        )
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = wrapped
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


class _Sizes(TorchDispatchMode):
    """Every tensor an op returns inside the block: (op, dtype, shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.dtype, tuple(t.shape)))
        return out


def _mask_sized(seen: list[tuple[str, torch.dtype, tuple[int, ...]]], n: int) -> list[Any]:
    """The tensors shaped like an [n, n] mask or score matrix (two trailing dims of n or more), or
    bool ones of n * n elements or more: (numel, op, dtype, shape)."""
    out = []
    for op, dtype, shape in seen:
        numel = 1
        for d in shape:
            numel *= d
        square = len(shape) >= 2 and min(shape[-2:]) >= n
        if square or (dtype == torch.bool and numel >= n * n):
            out.append((numel, op, dtype, shape))
    return sorted(out, reverse=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_the_packed_forward_is_the_dense_masks_and_each_sequences_own(tmp_path: Path, arch: str):
    model = _model(arch, tmp_path)
    rows, batch = _batch()
    n = model.config.num_hidden_layers
    layers = list(range(n + 1))
    real = _real(batch)
    with torch.no_grad():
        hidden, logits = _packed(model, batch, layers)
        dense = _dense_forward(model, batch)
        for i in layers:
            torch.testing.assert_close(
                hidden[i][real], dense.hidden_states[i][real], rtol=1e-5, atol=1e-5
            )
        torch.testing.assert_close(logits[real], dense.logits[real], rtol=1e-5, atol=1e-5)
        for r, s, e in doc_segments(batch["doc"]):
            own = model(
                input_ids=batch["input_ids"][r : r + 1, s:e],
                output_hidden_states=True,
                use_cache=False,
            )
            for i in layers:
                torch.testing.assert_close(
                    hidden[i][r, s:e], own.hidden_states[i][0], rtol=1e-5, atol=1e-5
                )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_packed_forward_in_bfloat16_is_close_to_the_dense_masks(tmp_path: Path, arch: str):
    model = _model(arch, tmp_path, torch.bfloat16)
    _, batch = _batch()
    n = model.config.num_hidden_layers
    real = _real(batch)
    with torch.no_grad():
        hidden, _ = _packed(model, batch, [n], logits=False)
        dense = _dense_forward(model, batch).hidden_states[n]
    torch.testing.assert_close(hidden[n][real].float(), dense[real].float(), rtol=0.05, atol=0.05)


def test_no_mask_of_the_packs_size_is_built(tmp_path: Path):
    """Before: a [2, 1, 256, 256] bool mask (131072 elements), its [256, 256] causal part, and the
    SDPA kernel's float copy of it; after: nothing with two trailing dims of T."""
    model = _model("llama", tmp_path)
    _, batch = _batch()
    n = model.config.num_hidden_layers
    sizes = _Sizes()
    with torch.no_grad(), sizes:  # no logits: they are [B, T, V], V > T
        _packed(model, batch, [n], logits=False)
    masks = _mask_sized(sizes.seen, T)
    assert not masks, f"largest: {masks[0]}"


def test_sdpa_runs_causal_per_sequence_on_the_models_own_key_value_heads(tmp_path: Path):
    model = _model("llama", tmp_path)
    _, batch = _batch()
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # a GQA model
    with torch.no_grad(), _sdpa_calls() as calls:
        _packed(model, batch, [1], logits=False)
    lengths = [n for row in LENGTHS for n in row]
    assert len(calls) == cfg.num_hidden_layers * len(lengths)  # one per sequence and layer
    assert [c["key"][2] for c in calls] == lengths * cfg.num_hidden_layers
    assert all(c["key"][1] == cfg.num_key_value_heads for c in calls)
    assert all(c["query"][1] == cfg.num_attention_heads for c in calls)
    assert all(c["is_causal"] and c["gqa"] and not c["mask"] for c in calls)


def test_the_padding_attends_nothing_and_nothing_sees_it(tmp_path: Path):
    model = _model("llama", tmp_path)
    _, batch = _batch()
    pad = ~_real(batch)
    caught: list[torch.Tensor] = []
    attn = model.model.layers[0].self_attn
    hook = attn.o_proj.register_forward_pre_hook(lambda m, args: caught.append(args[0]))
    other = {**batch, "input_ids": batch["input_ids"].masked_fill(pad, 7)}
    n = model.config.num_hidden_layers
    try:
        with torch.no_grad():
            outs = [_packed(model, b, [n])[0][n] for b in (batch, other)]
    finally:
        hook.remove()
    assert pad.any()
    # a padding query's attention output is 0 (with padding tokens other than the pad id, whose
    # embedding is 0)
    assert caught[1][pad].eq(0).all() and caught[1][~pad].ne(0).any()
    torch.testing.assert_close(outs[0][~pad], outs[1][~pad], rtol=0, atol=0)


def test_gradients_through_the_packed_forward_are_the_dense_masks(tmp_path: Path):
    """The adapted target (Medusa-2) trains through this forward: the same weight gradients."""
    model = _model("llama", tmp_path, torch.float64)
    _, batch = _batch()
    n = model.config.num_hidden_layers
    real = _real(batch)
    weight = model.model.layers[1].self_attn.k_proj.weight
    weight.requires_grad_(True)
    grads = []
    for packed in (True, False):
        if packed:
            h = _packed(model, batch, [n], logits=False)[0][n]
        else:
            h = _dense_forward(model, batch).hidden_states[n]
        (g,) = torch.autograd.grad(h[real].pow(2).sum(), weight)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-9)


def test_a_window_longer_than_every_sequence_is_plain_causal(tmp_path: Path):
    """Mistral with a 48-token window: sequences of at most 48 tokens run per sequence (the window
    cannot apply); a longer one keeps transformers' own packed path. Both are each sequence's own
    forward."""
    model = _model("mistral_swa", tmp_path)
    n = model.config.num_hidden_layers
    for lengths, ours in (([[48, 30], [40]], True), ([[70, 20], [60]], False)):
        _, batch = _batch(lengths, 100)
        with torch.no_grad():
            with _sdpa_calls() as calls:
                hidden, _ = _packed(model, batch, [n])
            assert all(not c["mask"] for c in calls) == ours
            for r, s, e in doc_segments(batch["doc"]):
                own = model(
                    input_ids=batch["input_ids"][r : r + 1, s:e],
                    output_hidden_states=True,
                    use_cache=False,
                )
                torch.testing.assert_close(
                    hidden[n][r, s:e], own.hidden_states[n][0], rtol=1e-5, atol=1e-5
                )


def test_doc_segments_are_each_rows_sequences_and_refuse_a_split_one():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 2, 2, 2, 2]])
    assert doc_segments(doc) == [(0, 0, 3), (0, 3, 5), (1, 0, 1), (1, 1, 2), (1, 2, 6)]
    with pytest.raises(HeadwayError, match="not contiguous"):
        doc_segments(torch.tensor([[0, 0, 1, 0, -1]]))


def test_given_only_the_devices_sequence_ids_the_forward_keeps_the_dense_mask(tmp_path: Path):
    """A caller with no bounds on the host (only `doc`): the dense document-causal mask, the same
    hidden states, and no read of `doc` back to the host."""
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in {"item", "tolist", "cpu", "nonzero", "__bool__", "unique_consecutive"}:
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    model = _model("llama", tmp_path)
    _, batch = _batch()
    n = model.config.num_hidden_layers
    real = _real(batch)
    with torch.no_grad():
        with Reads() as reads, _sdpa_calls() as calls:
            hidden, _ = target_features(
                model, batch["input_ids"], [n], batch["positions"], batch["doc"], logits=False
            )
        ours, _ = _packed(model, batch, [n], logits=False)
    assert reads.names == []
    assert calls and all(c["mask"] for c in calls)
    torch.testing.assert_close(hidden[n][real], ours[n][real], rtol=1e-5, atol=1e-5)


def test_bounds_outside_the_batch_are_refused(tmp_path: Path):
    model = _model("llama", tmp_path)
    _, batch = _batch()
    with pytest.raises(HeadwayError, match="fall outside"):
        target_features(
            model, batch["input_ids"], [1], batch["positions"], segments=[(0, 0, T + 1)]
        )

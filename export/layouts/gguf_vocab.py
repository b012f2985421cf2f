"""The target's tokenizer as llama.cpp's GGUF vocabulary keys (tokenizer.ggml.*), written into an
exported head so that llama.cpp checks the draft and the target share one vocabulary
(src/llama-vocab.cpp reads them; convert_hf_to_gguf.py's get_vocab_base and its BPE pre-tokenizer
choice are what this mirrors)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Optional

from headway.errors import HeadwayError

ARCH = "eagle3"  # the draft's GGUF architecture (llama.cpp's src/models/eagle3.cpp)
# token types of src/llama-vocab.cpp (gguf.TokenType)
NORMAL, USER_DEFINED, CONTROL, UNUSED = 1, 4, 3, 5


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special: added tokens it types CONTROL though not
    marked special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _bpe_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary as convert_hf_to_gguf.py's get_vocab_base lists it: every id up
    to the target's vocab_size, added tokens normalised and typed CONTROL or USER_DEFINED, holes as
    [PAD{i}]."""
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types


def target_vocab(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The target's tokenizer as GGUF keys, as convert_hf_to_gguf.py writes it from the directory
    `headway target export` saves: a SentencePiece-style tokenizer.json (byte fallback) as model
    `llama` through gguf's LlamaHfVocab, a byte-level BPE as model `gpt2`; then gguf's SpecialVocab
    (merges, special ids, add_bos/add_eos, the chat template).

    llama.cpp loads a vocabulary with every model, the draft too: its size is the n_vocab d2t
    scatters the draft's logits into (llama.cpp's draft-model path also compares token texts and
    BOS/EOS with the target's; its eagle3 path does not). A 49152-token vocabulary gets
    add_bos_token=false, as the converter's LlamaModel.set_vocab writes it.
    tokenizer.ggml.pre is `default`: llama.cpp reads it only to split text before BPE, which a draft
    never does (it is fed the target's ids)."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="headway-gguf-vocab-") as tmp:
        d = Path(tmp)
        tokenizer.save_pretrained(d)
        keys: dict[str, Any] = {}
        try:
            hf = gguf.LlamaHfVocab(d)
        except (FileNotFoundError, TypeError):
            hf = None
        if hf is not None:
            rows = list(hf.all_tokens())
            tokens = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t, _, _ in rows]
            scores = [float(s) for _, s, _ in rows]
            types = [int(k) for _, _, k in rows]
            keys["tokenizer.ggml.model"] = "llama"
            keys["tokenizer.ggml.scores"] = scores
        else:
            model = _tokenizer_json_model(d)
            if model != "BPE":
                raise HeadwayError(
                    f"--format gguf writes the target's tokenizer as llama.cpp reads it; this target's is a "
                    f"{model} tokenizer, which this exporter does not convert: export the head with "
                    "--format vllm or sglang"
                )
            tokens, types = _bpe_tokens(tokenizer, vocab_size)
            keys["tokenizer.ggml.model"] = "gpt2"
        if len(tokens) > vocab_size:
            raise HeadwayError(
                f"the target's tokenizer has {len(tokens)} tokens, more than its vocab_size {vocab_size}: "
                "the target's config and tokenizer do not match"
            )
        # ids the model has and the tokenizer lacks, as [PAD{i}]
        pad = range(len(tokens), vocab_size)
        tokens += [f"[PAD{i}]" for i in pad]
        types += [UNUSED for _ in pad]
        if "tokenizer.ggml.scores" in keys:
            keys["tokenizer.ggml.scores"] += [-1000.0 for _ in pad]
        keys.update(
            {
                "tokenizer.ggml.pre": "default",
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types,
            }
        )
        prefix = _add_prefix_space(d)
        if prefix is not None:
            keys["tokenizer.ggml.add_space_prefix"] = prefix
        collector = gguf.GGUFWriter(None, ARCH)
        gguf.SpecialVocab(
            d, load_merges=keys["tokenizer.ggml.model"] == "gpt2", n_vocab=vocab_size
        ).add_to_gguf(collector, quiet=True)
        keys.update(
            {k: v.value for k, v in collector.kv_data[0].items() if k.startswith("tokenizer.")}
        )
        # LlamaModel.set_vocab's rule for 49152-token vocabularies (SmolLM2's too)
        if vocab_size == 49152:
            keys["tokenizer.ggml.add_bos_token"] = False
    return keys


def _tokenizer_json_model(d: Path) -> str:

    f = d / "tokenizer.json"
    if not f.is_file():
        return "slow (no tokenizer.json)"
    return str(json.loads(f.read_text(encoding="utf-8")).get("model", {}).get("type", "unknown"))


def _add_prefix_space(d: Path) -> Optional[bool]:
    """tokenizer_config.json's add_prefix_space, which convert_hf_to_gguf.py copies to
    add_space_prefix."""

    f = d / "tokenizer_config.json"
    if not f.is_file():
        return None
    value = json.loads(f.read_text(encoding="utf-8")).get("add_prefix_space")
    return None if value is None else bool(value)

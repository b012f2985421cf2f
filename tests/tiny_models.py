"""Tiny random causal LMs (Llama, Qwen2, Mistral, Gemma-3) with a tiny tokenizer and chat template.

Each is saved as a plain HF directory in a temp folder, so tests exercise the same loading code as
real targets, in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is two plus three? Two plus three is five.",
    "Write a short poem about the sea and the sky.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Please answer the question step by step, then give the result.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000.",
    "Hello! How are you today? I am fine, thank you.",
]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPECIALS = ["<pad>", "<bos>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"]
ARCHS = ("llama", "qwen2", "mistral", "gemma3")


def make_tokenizer(arch: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    gemma = arch.startswith("gemma")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<end_of_turn>" if gemma else "<|im_end|>",
        pad_token="<pad>",
    )
    fast.chat_template = GEMMA if gemma else CHATML
    return fast


def make_config(arch: str, vocab_size: int, tokenizer):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=128, query_pre_attn_scalar=16)
    raise ValueError(f"unknown tiny arch {arch}")


def make_tiny_model(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Build and save a tiny random `arch` model with tokenizer and chat template; returns its directory."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = make_tokenizer(arch)
    # Padded like real models' embeddings (some tokenizer classes add a token when reloaded).
    config = make_config(arch, (len(tokenizer) + 16) // 16 * 16, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir

"""Tiny random causal LMs of every family Headway claims (FAMILIES; ARCHS: the four most tests run
on), with a tiny tokenizer and chat template.

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
# Every family of the CI matrix (tests/target/test_families.py): the ids make_config builds. llama3:
# Llama with Llama-3's rope scaling; mistral_swa: Mistral with a sliding window shorter than a
# decoded conversation; falcon_h1, qwen3_next and lfm2: hybrid recurrent families (refused for
# speculative decoding).
FAMILIES = (
    "llama",
    "llama3",
    "qwen2",
    "mistral",
    "mistral_swa",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "gemma2",
    "gemma3",
    "smollm3",
    "phi3",
    "olmo2",
    "granite",
    "glm",
    "falcon_h1",
    "qwen3_next",
    "lfm2",
)


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
    """A tiny random config of family `arch` (a FAMILIES id): 4 layers of width 64 where the family
    allows."""
    import transformers as T

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
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    # mixed sliding-window and full layers, with a window shorter than a decoded conversation
    mixed = ["sliding_attention", "full_attention"] * 2
    builders = {
        "llama": lambda: T.LlamaConfig(**common),
        "llama3": lambda: T.LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "qwen2": lambda: T.Qwen2Config(**common),
        "mistral": lambda: T.MistralConfig(**common, sliding_window=None),
        "mistral_swa": lambda: T.MistralConfig(**common, sliding_window=48),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=16),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, **moe),
        "mixtral": lambda: T.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
        ),
        "gpt_oss": lambda: T.GptOssConfig(
            **{**common, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=48,
            layer_types=mixed,
        ),
        "gemma2": lambda: T.Gemma2Config(
            **common, head_dim=16, sliding_window=48, query_pre_attn_scalar=16, layer_types=mixed
        ),
        "gemma3": lambda: T.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=128, query_pre_attn_scalar=16
        ),
        # every fourth layer without rotary embedding (NoPE), as SmolLM3-3B
        "smollm3": lambda: T.SmolLM3Config(**common, no_rope_layer_interval=4),
        "phi3": lambda: T.Phi3Config(**common),
        "olmo2": lambda: T.Olmo2Config(**common),
        "granite": lambda: T.GraniteConfig(
            **common,
            embedding_multiplier=2.0,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            logits_scaling=4.0,
        ),
        "glm": lambda: T.GlmConfig(**common, head_dim=16),
        "falcon_h1": lambda: T.FalconH1Config(
            **common,
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
        ),
        "qwen3_next": lambda: T.Qwen3NextConfig(
            **common,
            head_dim=16,
            num_experts=4,
            **moe,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        "lfm2": lambda: T.Lfm2Config(
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            block_ff_dim=128,
            layer_types=["conv", "full_attention"] * 2,
        ),
    }
    if arch not in builders:
        raise ValueError(f"unknown tiny arch {arch}")
    return builders[arch]()


def make_tiny_model(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Build and save a tiny random `arch` model with tokenizer and chat template; returns its
    directory."""
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

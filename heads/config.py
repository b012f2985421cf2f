"""The `head.<kind>` config sections, one dataclass per head kind.

Torch-free, like every config module: the command line checks a whole run config (and refuses a
misspelt key or a value out of range) before it loads torch. Each kind's module in heads/ builds its
torch module from its section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from headway.config import check_choice
from headway.errors import HeadwayError

# What an EAGLE head's decoder layer is: a Llama layer sized from the target (what vLLM, SGLang and
# TensorRT-LLM build for an EAGLE draft, whatever the target's family), or the target's own layer
# class.
DRAFT_LAYERS = ("llama", "target")

# How EAGLE-3.1 normalises the fused target features before fc (Eagle3Config.input_norm).
INPUT_NORMS = ("none", "per_layer", "concat")
# The per-step losses training can use (train/losses.py computes them).
DRAFT_LOSSES = ("soft_ce", "argmax_ce", "tv", "soft_ce+tv")


def check_fused_layers(section: str, layers: list[int]) -> None:
    """Fused feature layers as a config gives them: 3 distinct ascending layer outputs (>= 1), or
    [] (default)."""
    if layers and (len(layers) != 3 or layers != sorted(set(layers)) or layers[0] < 1):
        raise HeadwayError(
            f"{section}.feature_layers={layers}: give 3 distinct target layer outputs in ascending order, "
            "each from 1 (the output of the first decoder layer, HF output_hidden_states indexing) to the "
            "last layer's index minus one (engines capture layer outputs in ascending order, before the "
            "final norm), e.g. [2, 15, 27] on a 30-layer target; or [] for the default"
        )


@dataclass
class LoraConfig:
    """Medusa-2 (head.medusa.lora): LoRA adapters on the target, trained with the heads after a
    heads-only warm-up."""

    # Off = Medusa-1 (frozen target). On = Medusa-2: decoding then runs the adapted target, whose
    # output is what speculative decoding reproduces exactly (not the original target's).
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    # Learning rate of the adapters (the heads use train.lr).
    lr: float = 1e-4
    # Steps that train the heads alone before the adapters join.
    heads_warmup_steps: int = 100
    # Weight of the distillation loss: KL from the frozen target's next-token distribution to the
    # adapted one's.
    distill_weight: float = 1.0


@dataclass
class MedusaConfig:
    # Number of heads: head i guesses the token i+2 positions after the hidden state's token.
    num_heads: int = 4
    # Residual blocks per head.
    num_layers: int = 1
    # Vocabulary projection: own (per head, from the target's lm_head), shared (the frozen target
    # lm_head), reduced (per head, over the draft_vocab_size most frequent training tokens).
    lm_head: str = "reduced"
    # Size of the reduced draft vocabulary (lm_head=reduced).
    draft_vocab_size: int = 8192
    # Loss to the self-distilled token (ce) or to the target's own distribution there (kl).
    loss: str = "ce"
    # Head i's loss weight is decay ** i.
    decay: float = 0.8
    # Medusa-2: LoRA adapters on the target, trained with the heads; off by default (Medusa-1).
    lora: LoraConfig = field(default_factory=LoraConfig)

    # Fields that shape training only: a head trained with other values can continue under
    # these (train.init_from).
    training_fields: ClassVar[tuple[str, ...]] = ("loss", "decay", "lora")

    def __post_init__(self) -> None:
        check_choice("head", "lm_head", self.lm_head, ["own", "shared", "reduced"])
        check_choice("head.medusa", "loss", self.loss, ["ce", "kl"])
        if self.num_heads < 1 or self.num_layers < 0:
            raise HeadwayError("head.num_heads must be >= 1 and head.num_layers >= 0")


@dataclass
class EagleConfig:
    # Width of the uniform noise added to the target's features in training (EAGLE: U(-0.1, 0.1)).
    feature_noise: float = 0.2
    # Loss = feature_weight x smooth-L1(feature) + token_weight x cross-entropy to the target's
    # distribution.
    feature_weight: float = 1.0
    token_weight: float = 0.1
    # A bias in fc (the original EAGLE has one; vLLM's EAGLE-1 has none, so an fc bias keeps the
    # head out of vLLM).
    fc_bias: bool = False
    # The draft layer: llama (a Llama layer with the target's sizes: what vLLM, SGLang and
    # TensorRT-LLM serve, whatever the target's family) or target (the target's own layer class:
    # Headway decoding only).
    draft_layer: str = "llama"

    def __post_init__(self) -> None:
        check_choice("head.eagle", "draft_layer", self.draft_layer, list(DRAFT_LAYERS))
        if self.feature_noise < 0 or self.feature_weight < 0 or self.token_weight < 0:
            raise HeadwayError(
                "head.eagle: feature_noise, feature_weight and token_weight must be >= 0"
            )


@dataclass
class Eagle3Config:
    # Target hidden-state indices (HF output_hidden_states) fused as features; empty = (2, L//2,
    # L-3), the EAGLE-3 paper's low/middle/high layers and what vLLM and SGLang feed by default.
    feature_layers: list[int] = field(default_factory=list)
    # Reduced draft vocabulary: the most frequent tokens of the training data (d2t/t2d map it).
    draft_vocab_size: int = 8192
    # Training-time test: the drafter unrolled this many steps on its own outputs; step i weighs
    # decay^i. 3 beat 7 at an hour of CPU training (docs/benchmarks.md), and is what vLLM's
    # speculators trains.
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    # What each step learns: soft_ce (cross-entropy to the target's distribution over the draft
    # vocabulary, EAGLE-3's), argmax_ce (cross-entropy on the target's greedy token, what greedy
    # verification accepts), tv (total variation: 1 - TV is lossless sampling's acceptance rate) or
    # soft_ce+tv.
    loss: str = "soft_ce"
    # The draft layer: llama (a Llama layer with the target's sizes: what vLLM, SGLang and
    # TensorRT-LLM serve, whatever the target's family) or target (the target's own layer class:
    # Headway decoding only).
    draft_layer: str = "llama"
    # Start the draft layer as a copy of this target layer (attention on the hidden half of its
    # input, MLP, norms); -1 = random initialisation.
    init_layer: int = -1
    # EAGLE-3.1's norms (off by default, and for heads saved before they existed). input_norm: what
    # normalises the fused target features before fc: none; per_layer (an RMSNorm on each fused
    # layer's hidden state, EAGLE-3.1's; speculators' fc_norm); or concat (one RMSNorm over the
    # three concatenated; speculators' norm_before_fc).
    input_norm: str = "none"
    # Feed the drafter's output back as the next step's hidden after its final norm (EAGLE-3.1;
    # speculators' norm_output), in training-time test and in drafting alike, instead of the raw
    # layer output.
    norm_output: bool = False

    # Fields that shape training only: a head trained with other values can continue under these
    # (train.init_from); every other field shapes the weights.
    training_fields: ClassVar[tuple[str, ...]] = ("ttt_steps", "ttt_decay", "loss", "init_layer")
    # Fields a head trained without can be continued under (train.init_from): the norms they add
    # start at their initial weights (ones); every other weight is the head's.
    added_fields: ClassVar[tuple[str, ...]] = ("input_norm", "norm_output")

    def __post_init__(self) -> None:
        check_fused_layers("head.eagle3", list(self.feature_layers))
        check_choice("head.eagle3", "draft_layer", self.draft_layer, list(DRAFT_LAYERS))
        if self.draft_vocab_size < 2 or self.ttt_steps < 1:
            raise HeadwayError("head.eagle3: draft_vocab_size must be >= 2 and ttt_steps >= 1")
        check_choice("head.eagle3", "loss", self.loss, list(DRAFT_LOSSES))
        if self.init_layer < -1:
            raise HeadwayError(
                f"head.eagle3.init_layer={self.init_layer}: use a target layer index, or -1 for random"
            )
        check_choice("head.eagle3", "input_norm", self.input_norm, list(INPUT_NORMS))


@dataclass
class DFlashConfig:
    # Tokens per block: the anchor (the last accepted token) and block_size - 1 mask slots, each
    # drafting one token; one drafter forward drafts them all.
    block_size: int = 8
    # Decoder layers in the drafter (each reads the context through its own key/value projections).
    num_layers: int = 1
    # Target hidden-state indices (HF output_hidden_states) fused as the context; empty = (2, L//2,
    # L-3), what vLLM feeds a DFlash draft by default.
    feature_layers: list[int] = field(default_factory=list)
    # The token the mask slots embed (through the target's embedding); -1 = the target's last
    # vocabulary id.
    mask_token_id: int = -1
    # The read-out: own (an lm_head of the head's own over a reduced draft vocabulary, started from
    # the target's rows; vLLM serves it) or target (the target's frozen lm_head over its whole
    # vocabulary, shared and never saved; SGLang and vLLM serve it).
    lm_head: str = "own"
    # Reduced draft vocabulary (lm_head=own): the most frequent tokens of the training data (d2t
    # maps it to the target's).
    draft_vocab_size: int = 8192
    # Anchors drawn per training sequence (answer positions; each anchor trains one block).
    anchors: int = 32
    # Slot j's loss weighs exp(-(j - 1) / loss_gamma): near slots matter most, since a chain stops
    # at a miss.
    loss_gamma: float = 4.0
    # What each slot learns (train/losses.py): soft_ce, argmax_ce, tv or soft_ce+tv.
    loss: str = "soft_ce"
    # The drafter's layer shape: llama (the target's sizes, GQA and RoPE, with per-head q/k norms).
    draft_layer: str = "llama"

    # Fields that shape training only: a head trained with other values can continue under these.
    training_fields: ClassVar[tuple[str, ...]] = ("anchors", "loss_gamma", "loss")

    def __post_init__(self) -> None:
        if (
            self.block_size < 2
            or self.num_layers < 1
            or self.draft_vocab_size < 2
            or self.anchors < 1
        ):
            raise HeadwayError(
                "head.dflash: block_size must be >= 2, num_layers, anchors >= 1 and draft_vocab_size >= 2"
            )
        if self.mask_token_id < -1 or self.loss_gamma <= 0:
            raise HeadwayError(
                "head.dflash: mask_token_id must be a token id or -1, and loss_gamma > 0"
            )
        check_choice("head.dflash", "loss", self.loss, list(DRAFT_LOSSES))
        check_choice("head.dflash", "lm_head", self.lm_head, ["own", "target"])
        check_choice("head.dflash", "draft_layer", self.draft_layer, ["llama"])
        check_fused_layers("head.dflash", list(self.feature_layers))

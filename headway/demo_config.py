"""`headway demo`'s config: which head, which prompts, and (--train) the budget of the pipeline it
runs first.

Torch-free, like every config module: the command line checks it before `headway demo` loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from headway.data_scripts.config import DistillConfig, MagpieConfig
from headway.errors import HeadwayError
from headway.inference.config import InferenceConfig
from headway.kinds.config import HeadConfig
from headway.target.config import TargetConfig
from headway.train.config import TrainConfig


def demo_config_file() -> Path:
    """configs/demo_smollm2.yaml, shipped in the package: what `headway demo` loads when no --config
    is given."""
    from importlib.resources import files

    return Path(str(files("headway.configs"))) / "demo_smollm2.yaml"


def reference_head() -> Path:
    """The EAGLE-3 head shipped with Headway for the default target (its README.md says how it was
    made)."""
    from importlib.resources import files

    return Path(str(files("headway.heads"))) / "reference" / "smollm2-135m-instruct-eagle3"


DEMO_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What is 15% of 240? Show your steps.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "Summarize in two sentences: The town library will close for renovation from June to August. During "
    "that time, books can be borrowed from the school library on Main Street, which will open every weekday "
    "from 9 am to 6 pm. The renovated library will have a new children's room and a cafe.",
    "Give me a packing list for a three-day hiking trip.",
]


@dataclass
class DemoConfig:
    """The demo: which head, which prompts, and (--train) the budget of the pipeline it runs
    first."""

    target: TargetConfig = field(default_factory=TargetConfig)
    # Head to decode with; null = the EAGLE-3 head shipped with Headway (or, with --train, the one
    # trained here).
    head_dir: Optional[str] = None
    # User messages decoded with plain and speculative decoding; a mix of kinds.
    prompts: list[str] = field(default_factory=lambda: list(DEMO_PROMPTS))
    max_new_tokens: int = 128
    # Rounds: every prompt is decoded plainly and speculatively this many times (each pair back to
    # back, the order alternating), and the speedup reported is the median of the rounds' speedups,
    # with their range.
    rounds: int = 3
    # A range wider than this fraction of the median is reported as wide, with what to do about it.
    wide_spread: float = 0.1
    # Characters of each answer to print.
    show_chars: int = 300
    # Results (results.json) and, with --train, the dataset, the training run and the export.
    output_dir: str = "outputs/demo"
    # Decoding settings (tree, sampling): the recipe's (configs/eagle3_smollm2.yaml). The head's
    # tuned tree for this machine (tuned.json) wins when it has one (`headway tune`).
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    # The drafter's depth where the demo decodes in float32, whose draft levels cost about twice
    # bf16's: on the demo's prompts one level measured fastest in float32, while in bf16 one and
    # three measured alike and three accept more per step (docs/benchmarks.md). null:
    # inference.depth in float32 too.
    float32_depth: Optional[int] = 1
    # --train: the budget of the pipeline, stated in configs/demo_smollm2.yaml (the demo's default --config):
    # the self-distillation (the target writes magpie.num_prompts prompts itself and answers them),
    # the head trained, and its training.
    magpie: MagpieConfig = field(default_factory=MagpieConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise HeadwayError(f"rounds={self.rounds}: give 1 or more rounds of the prompts")
        if self.float32_depth is not None and self.float32_depth < 1:
            raise HeadwayError(
                f"float32_depth={self.float32_depth}: give a depth >= 1, or null for inference.depth"
            )

"""One run config for every command: a recipe YAML holds all its sections, each command reads its
own.

Sections: target, prompts + magpie + distill (self-distillation), features (offline target
    features),
head + train + logging (training),
inference (decoding), bench (`headway bench`), tune (`headway tune`). An unknown section or key
anywhere is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from headway.data_scripts.config import DistillConfig, MagpieConfig, PromptConfig
from headway.errors import HeadwayError
from headway.heads.config import LoraConfig
from headway.inference.config import BenchConfig, InferenceConfig, TuneConfig
from headway.kinds.config import HeadConfig
from headway.target.config import TargetConfig
from headway.train.config import FeaturesConfig, LoggingConfig, TrainConfig


@dataclass
class RunConfig:
    # Keys older configs (a recipe, an override, a run's saved config.yaml) may hold -> the keys
    # they are read as; load_config moves them before merging, with a warning. Moved in issue 54:
    # Medusa's own training settings are its head section's, beside its other settings.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "train.loss": "head.medusa.loss",
        "train.decay": "head.medusa.decay",
        "train.lora": "head.medusa.lora",
    }

    target: TargetConfig = field(default_factory=TargetConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    magpie: MagpieConfig = field(default_factory=MagpieConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def __post_init__(self) -> None:
        lora = self.target_lora()
        if lora is not None and self.train.backend in ("fsdp", "deepspeed"):
            raise HeadwayError(
                f"train.backend={self.train.backend} wraps the head alone, but Medusa-2's LoRA adapters "
                f"(head.{self.head.kind}.lora.enabled) live in the target: train Medusa-2 with "
                "train.backend=ddp"
            )
        if lora is not None and self.train.features_dir:
            raise HeadwayError(
                "train.features_dir (offline features) cannot train Medusa-2 "
                f"(head.{self.head.kind}.lora.enabled): its LoRA target must run in every step; unset one "
                "of them"
            )

    def target_lora(self) -> Optional[LoraConfig]:
        """The LoRA adapters this run trains on the target with its head (Medusa-2:
        head.medusa.lora), or None."""
        lora = getattr(self.head.kind_config(), "lora", None)
        return lora if lora is not None and lora.enabled else None

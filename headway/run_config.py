"""One run config for every command: a recipe YAML holds all its sections, each command reads its own.

Sections: target, prompts + magpie + distill (self-distillation), features (offline target features),
head + train + logging (training),
inference (decoding), bench (`headway bench`), tune (`headway tune`). An unknown section or key anywhere is an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headway.data_scripts.config import DistillConfig, MagpieConfig, PromptConfig
from headway.inference.config import BenchConfig, InferenceConfig, TuneConfig
from headway.kinds.config import HeadConfig
from headway.target.config import TargetConfig
from headway.train.config import FeaturesConfig, LoggingConfig, TrainConfig


@dataclass
class RunConfig:
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

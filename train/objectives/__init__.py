"""What each head kind learns from the frozen target's features on one batch: one module per kind
(medusa, eagle, eagle3, dflash), each an `Objective` (common.py), named by the kind in `OBJECTIVES`
(every kind of kinds/registry.py has one; tests/headway/test_structure.py checks).

The shared parts are importable from here: `Features` (the target's side of a batch) and the
`Objective` interface.
"""

from headway.train.objectives.common import Features, Objective, target_logits
from headway.train.objectives.dflash import DFlashObjective
from headway.train.objectives.eagle import EagleObjective
from headway.train.objectives.eagle3 import Eagle3Objective
from headway.train.objectives.medusa import MedusaObjective

# kind -> its Objective subclass: (kind config, seed=, loss_chunk=, ttt_attention=) -> objective
OBJECTIVES: dict[str, type[Objective]] = {
    "medusa": MedusaObjective,
    "eagle": EagleObjective,
    "eagle3": Eagle3Objective,
    "dflash": DFlashObjective,
}

__all__ = ["OBJECTIVES", "Features", "Objective", "target_logits"]

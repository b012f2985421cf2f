"""What each head kind learns from the frozen target's features on one batch: one module per kind (medusa,
eagle, eagle3, dflash), each an `Objective` (common.py) that its kind's spec names (kinds/<kind>.py, the
one registration).

The shared parts are importable from here: `Features` (the target's side of a batch) and the
`Objective` interface.
"""

from headway.train.objectives.common import Features, Objective, target_logits

__all__ = ["Features", "Objective", "target_logits"]

"""The neural drafter (`inference.drafter=neural`): each head kind's own, by the kind's name.

Every kind registered in kinds/registry.py has one here (tests/headway/test_structure.py checks the
two agree).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from headway.inference.drafters.dflash import DFlashDrafter
from headway.inference.drafters.eagle import EagleDrafter
from headway.inference.drafters.medusa import MedusaDrafter
from headway.inference.engines.options import EngineOptions

# kind -> (heads, InferenceConfig, head config.json, num target layers, options=EngineOptions) ->
# drafter
NEURAL: dict[str, Callable[..., Any]] = {
    "medusa": MedusaDrafter.from_config,
    "eagle": EagleDrafter.from_config,
    "eagle3": EagleDrafter.from_config,
    "dflash": DFlashDrafter.from_config,
}


def neural_drafter(
    heads: Any,
    inference: Any,
    head_config: dict,
    num_target_layers: int,
    options: Optional[EngineOptions] = None,
) -> Any:
    """The drafter of `heads`' kind as the inference section sets it up.

    Args:
        heads: the loaded head module (its `kind` names the drafter).
        inference: the InferenceConfig (tree, depth, top_k, total_tokens, engine).
        head_config: the head directory's config.json.
        num_target_layers: the target's decoder layer count.
        options: the engine settings a drafter running a layer of its own (EAGLE) follows.
    """
    return NEURAL[heads.kind](heads, inference, head_config, num_target_layers, options=options)

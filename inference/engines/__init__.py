"""The target's side of decoding: which engine runs a target's forward (runner.py) and the engines
themselves.

`static/` keeps the KV cache in preallocated tensors and runs the model's own modules with its own
attention (CPU, with its C++ layer loop and row kernels); `cuda/` is the static engine's CUDA
backend (bucketed steps, graphs, the Triton tree attention, acceptance and the decoding loop on the
device); `hf.py` calls the model's own forward with a transformers cache. `batch.py` decodes many
sequences at once for self-distillation. The tree every engine verifies is `tree.py`.
"""

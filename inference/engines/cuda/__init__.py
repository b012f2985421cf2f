"""The static engine's CUDA backend (`inference.engine=cuda`): persistent buffers, one CUDA graph
per row bucket, the Triton tree attention, acceptance on the device and the one-read-a-step decoding
loop."""

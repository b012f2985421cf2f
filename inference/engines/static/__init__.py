"""The static engine (`inference.engine=static`): preallocated KV cache, row-exact attention, and
the C++ layer loop and row kernels (csrc/) built on first use."""

"""The frozen target: loading it from local files, its fingerprint, and the CPU weight formats of
its linear layers."""

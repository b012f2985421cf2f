"""What many tests share: tiny random models of every family, fake CUDA, the checks several
packages' tests run, and the repository's root."""

from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[2]  # the repository (configs/, docs/, heads/, scripts/)

"""Shared fixtures: tiny random models of several architectures, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tiny_models import ARCHS, make_tiny_model

torch.set_num_threads(int(os.environ.get("HEADWAY_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def tiny_dir(request, tiny_dirs) -> Path:
    return tiny_dirs[request.param]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """Where the real default target is cached: HEADWAY_CACHE when set (CI reuses it), else the user cache."""
    return Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))

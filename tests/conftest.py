"""Shared fixtures: tiny random models of several architectures, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import ARCHS, make_tiny_model

torch.set_num_threads(int(os.environ.get("HEADWAY_TEST_THREADS", "1")))
# Without a GPU, Triton kernels run in its interpreter on CPU tensors; triton reads this when a
# kernel is defined (on import), so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def tiny_dir(request, tiny_dirs) -> Path:
    return tiny_dirs[request.param]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """Where the real default target is cached: HEADWAY_CACHE when set (CI reuses it), else the user
    cache."""
    return Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))


@pytest.fixture(scope="session")
def tiny_data(tiny_dirs, tmp_path_factory) -> Path:
    """A small dataset self-distilled from the tiny Llama (24 prompts, 24 new tokens each)."""
    import json

    from headway.config import load_config
    from headway.data_scripts.distill import distill
    from headway.run_config import RunConfig

    root = tmp_path_factory.mktemp("tiny-data")
    rows = [
        {"instruction": f"Question {i}: what is {i} plus {i + 1}? Tell me a story about it."}
        for i in range(24)
    ]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        RunConfig,
        None,
        [
            f"target.name_or_path={tiny_dirs['llama']}",
            "target.device=cpu",
            "target.num_threads=1",
            f"prompts.path={root / 'p.jsonl'}",
            f"distill.output_dir={root / 'ds'}",
            "distill.engine=hf",
            "distill.max_new_tokens=24",
            "distill.batch_size=8",
        ],
    )
    return distill(cfg.target, cfg.prompts, cfg.distill, cfg.magpie)

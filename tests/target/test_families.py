"""The family matrix: a tiny random model of every family Headway claims
(tests/helpers/tiny_models.py FAMILIES), saved as an ordinary HF directory and taken through the
command line as a new user would: distill (hf engine), train EAGLE-3 for 2 steps, generate in the
default format on 3 prompts, export for vLLM. Each stage passes, or is refused in one line (exit 2,
`headway: error: ...`) where the family table (target/families.py) says it must be; no stage prints
a traceback, and every speculative output equals plain greedy decoding.

Also the family table itself: what each family resolves to before the model loads.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from headway.cli import main
from headway.errors import HeadwayError
from headway.target.config import TargetConfig
from headway.target.cpu_format import decoding_format
from headway.target.families import (
    FAMILIES as TABLE,
)
from headway.target.families import (
    choose_engine,
    engine_support,
    family_of,
    markdown,
    refuse_speculative,
)
from tests.helpers import ROOT_DIR
from tests.helpers.tiny_models import FAMILIES, make_tiny_model

PROMPTS = [
    "What is two plus three?",
    "Write a short poem about the sea.",
    "def add(a, b):",
]
# families whose EAGLE drafts no checked engine serves (the export is refused, with the reason)
UNSERVED = {"gemma3"}
TARGET = ["target.device=cpu", "target.num_threads=1"]


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    # the handlers a command's logging writes through (headway's, transformers' and its
    # integrations') write to this test's stderr, not to an earlier test's closed capture
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if type(handler) is logging.StreamHandler:  # (not pytest's own handlers)
                handler.stream = sys.stderr  # (setStream would flush the closed one)
                handler.__dict__.pop("flush", None)  # (transformers binds the first stderr's flush)
    rc = main(argv)
    out, err = capsys.readouterr()
    # logging's own report of a handler that a library bound to an earlier test's closed capture at
    # import (an artifact of running commands in one process, not the command's output)
    err = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n?", "", err, flags=re.S)
    assert "Traceback" not in out + err, f"{argv[0]}: {out}{err}"
    return rc, out, err


def _refused_in_one_line(rc: int, err: str, *words: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("headway: error:")]
    assert rc == 2 and len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_through_the_command_line(family: str, tmp_path: Path, capsys) -> None:
    target = make_tiny_model(family, tmp_path / "target")
    row = family_of(target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"instruction": f"Question {i}: {p}"}) + "\n"
            for i, p in enumerate(PROMPTS * 3)
        )
    )
    tgt = [f"target.name_or_path={target}", *TARGET]

    data = tmp_path / "data"
    rc, out, err = _run(
        capsys,
        [
            "distill",
            *tgt,
            f"prompts.path={prompts}",
            f"distill.output_dir={data}",
            "distill.engine=hf",
            "distill.max_new_tokens=20",
            "distill.batch_size=4",
        ],
    )
    assert rc == 0, err

    rc, out, err = _run(
        capsys,
        [
            "train",
            *tgt,
            f"train.datasets=[{data}]",
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=2",
            "train.micro_batch_size=2",
            "train.max_length=64",
            "train.eval_every=0",
            "train.save_every=2",
            "train.log_every=1",
        ],
    )
    assert rc == 0, err
    head = out.strip().splitlines()[-1].removeprefix("head: ").strip()
    assert (Path(head) / "model.safetensors").is_file(), out

    argv = ["generate", "--head", head, *tgt, "inference.max_new_tokens=120"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    rc, out, err = _run(capsys, argv)
    if row.refused:
        _refused_in_one_line(rc, err, "speculative decoding refuses", "recurrent state")
    else:
        assert rc == 0, err
        verdicts = [ln for ln in out.splitlines() if "identical to plain greedy" in ln]
        assert len(verdicts) == len(PROMPTS), out
        assert all(ln.endswith("identical to plain greedy: True") for ln in verdicts), out

    rc, out, err = _run(
        capsys,
        ["export", "--head", head, "--format", "vllm", "--out", str(tmp_path / "vllm"), *tgt],
    )
    if row.refused or family in UNSERVED:
        _refused_in_one_line(rc, err, "cannot serve")
    else:
        assert rc == 0, err
        assert (tmp_path / "vllm" / "config.json").is_file()


def test_every_matrix_family_has_a_row_and_the_docs_are_the_table() -> None:
    """Every family the matrix runs is a row of the table (none falls to the generic row), and
    docs/targets.md is what the table writes."""
    known = {t for f in TABLE for t in f.model_types}
    from tests.helpers.tiny_models import make_config, make_tokenizer

    for family in FAMILIES:
        tok = make_tokenizer(family)
        assert make_config(family, 416, tok).model_type in known, family
    docs = ROOT_DIR / "docs" / "targets.md"
    assert docs.read_text() == markdown()


def test_the_engine_and_format_each_family_resolves_to() -> None:
    """auto picks the static engine where the table runs the family there, else hf; on hf,
    target.dtype=auto is float32 with a line saying why, and an explicit bf16 is decoded as asked
    with a warning."""
    llama = {"model_type": "llama"}
    gemma2 = {"model_type": "gemma2", "sliding_window": 48, "layer_types": ["sliding_attention"]}
    assert choose_engine(llama, "auto", on_cuda=False) == "static"
    assert choose_engine(gemma2, "auto", on_cuda=False) == "hf"
    assert (
        choose_engine({"model_type": "gemma3_text", "sliding_window": 8}, "auto", on_cuda=True)
        == "cuda"
    )
    # a sliding window rules the static engine out, even for a family it runs
    assert (
        "sliding window"
        in engine_support({"model_type": "mistral", "sliding_window": 48})["static"]
    )
    # rope tables that rescale with the length cannot be precomputed per position
    dynamic = {"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    assert choose_engine(dynamic, "auto", on_cuda=False) == "hf"
    with pytest.raises(
        HeadwayError, match="inference.engine=static cannot run this Gemma-2 target"
    ):
        choose_engine(gemma2, "static", on_cuda=False)

    cfg = TargetConfig(device="cpu")
    resolved, why, warning = decoding_format(cfg, "hf", "this Gemma-2")
    assert (resolved.dtype, resolved.linear_weights, warning) == ("float32", "native", "")
    assert "float32, the format exact there" in why
    resolved, why, warning = decoding_format(TargetConfig(device="cpu", dtype="bfloat16"), "hf")
    assert resolved.dtype == "bfloat16" and "not exact" in warning


def test_recurrent_families_are_refused_in_one_line_and_unknown_ones_run_on_hf() -> None:
    for config in (
        {"model_type": "falcon_h1"},
        {"model_type": "qwen3_next"},
        {"model_type": "some_new_hybrid", "layer_types": ["mamba", "full_attention"]},
    ):
        with pytest.raises(HeadwayError, match="recurrent state") as e:
            refuse_speculative(config)
        assert "\n" not in str(e.value)
    unknown = {"model_type": "some_new_llm", "layer_types": ["full_attention", "sliding_attention"]}
    assert family_of(unknown).engines == ("hf",)
    assert choose_engine(unknown, "auto", on_cuda=False) == "hf"

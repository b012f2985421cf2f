"""Every command refuses bad input before any model loads (headway/checks.py): each case below runs
the command line with a target whose loading fails the test, and expects exit status 2 with one
message naming the thing and the fix."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from headway.cli import main
from tests.helpers import ROOT_DIR

HEAD = str(ROOT_DIR / "heads" / "reference" / "smollm2-135m-instruct-eagle3")
FINGERPRINT = json.loads((Path(HEAD) / "config.json").read_text())["target_fingerprint"]
# the modules whose jobs load a target or build a kernel; the fixture below makes each of those
# calls fail the test
JOBS = (
    "headway.data_scripts.distill",
    "headway.train.loop",
    "headway.train.feature_cache",
    "headway.inference.api",
    "headway.inference.bench.run",
    "headway.inference.tune.run",
    "headway.demo",
    "headway.export.exporter",
    "headway.target.loading",
)


def _reached(*args, **kwargs):
    pytest.fail("the command loaded a model before it checked its inputs")


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    for name in JOBS:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        # the whole target, and the part offline training loads (target/partial.py)
        for loader in ("load_target", "load_partial_target"):
            if name.startswith("headway.") and hasattr(module, loader):
                monkeypatch.setattr(module, loader, _reached)
    monkeypatch.setattr(sys.modules["headway.inference.api"].SpeculativeDecoder, "load", _reached)
    monkeypatch.setattr(
        sys.modules["headway.inference.engines.static.layer_loop"], "extension", _reached
    )


def _dataset(path: Path, fingerprint: dict = FINGERPRINT, finished: bool = True) -> str:
    path.mkdir(parents=True)
    if finished:
        (path / "manifest.json").write_text(json.dumps({"target_fingerprint": fingerprint}))
    else:
        (path / "run.json").write_text("{}")
    return str(path)


def _refused(capsys, argv: list[str], *expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("headway: error: ") and err.count("\n") == 1, err
    for part in expected:
        assert part in err, err


def test_bench_refuses_bad_prompts_and_outputs(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["hi"]}\n{"turns": ["there"]}\n{bad\n')
    _refused(
        capsys, ["bench", "--head", HEAD, "--prompts", str(bad)], f"{bad} line 3 is not valid JSON"
    )
    _refused(
        capsys,
        ["bench", "--head", HEAD, "--prompts", str(tmp_path / "none.jsonl")],
        "prompt file not found",
    )
    good = tmp_path / "good.jsonl"
    good.write_text('{"turns": ["hi"]}\n')
    _refused(
        capsys,
        ["bench", "--head", HEAD, "--prompts", str(good), "--out", str(tmp_path)],
        "is a directory",
    )
    (tmp_path / "old.md").write_text("an earlier result")
    _refused(
        capsys,
        ["bench", "--head", HEAD, "--prompts", str(good), "--out", str(tmp_path / "old.json")],
        "old.md already exist (an earlier result)",
    )
    _refused(capsys, ["bench", "--head", HEAD], "headway bench needs prompts")
    _refused(
        capsys,
        ["bench", "--head", HEAD, "--prompts", str(good), "prompts.offset=5"],
        "no prompts selected",
    )


def test_decoding_commands_refuse_a_bad_head(tmp_path, capsys):
    _refused(
        capsys, ["generate", "--head", str(tmp_path / "none"), "--prompt", "hi"], "does not exist"
    )
    (tmp_path / "empty").mkdir()
    _refused(capsys, ["generate", "--head", str(tmp_path / "empty")], "is not a head directory")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model.safetensors").write_bytes(b"")
    (odd / "config.json").write_text(json.dumps({"kind": "hydra"}))
    _refused(capsys, ["tune", "--head", str(odd)], "names head kind 'hydra'", "eagle3")
    (odd / "config.json").write_text("{not json")
    _refused(capsys, ["bench", "--head", str(odd), "--prompts", "x.jsonl"], "is not valid JSON")
    _refused(
        capsys, ["tune", "--head", HEAD, "tune.prompts=/nonexistent.jsonl"], "prompt file not found"
    )


def test_train_refuses_bad_datasets_before_the_target_loads(tmp_path, capsys):
    good = _dataset(tmp_path / "good")
    _refused(
        capsys, ["train", "train.datasets=[/nonexistent]"], "dataset /nonexistent does not exist"
    )
    _refused(capsys, ["train", "train.datasets=[]"], "no training data")
    (tmp_path / "plain").mkdir()
    _refused(
        capsys, ["train", f"train.datasets=[{tmp_path / 'plain'}]"], "is not a headway dataset"
    )
    unfinished = _dataset(tmp_path / "unfinished", finished=False)
    _refused(
        capsys,
        ["train", f"train.datasets=[{unfinished}]"],
        "is incomplete",
        "rerun the same `headway distill`",
    )
    other = _dataset(tmp_path / "other", {**FINGERPRINT, "vocab_size": 1000})
    _refused(
        capsys,
        ["train", f"train.datasets=[{good},{other}]"],
        "made by another target",
        "vocab_size",
    )
    _refused(
        capsys,
        ["train", f"train.datasets=[{good}]", f"train.eval_datasets=[{good}]"],
        "are also train.datasets",
    )
    _refused(
        capsys,
        ["train", f"train.datasets=[{good}]", f"train.init_from={tmp_path}"],
        "is not a head directory",
    )
    (tmp_path / "afile").write_text("")
    _refused(
        capsys,
        ["train", f"train.datasets=[{good}]", f"train.output_dir={tmp_path / 'afile'}"],
        "is a file",
    )
    features = tmp_path / "features"
    features.mkdir()
    (features / "manifest.json").write_text(
        json.dumps({"max_length": 512, "target_fingerprint": FINGERPRINT, "datasets": [good]})
    )
    _refused(
        capsys,
        [
            "train",
            f"train.datasets=[{good}]",
            f"train.features_dir=[{features}]",
            "train.max_length=1024",
        ],
        "cached with max_length=512",
        "train.max_length=1024",
    )
    _refused(capsys, ["cache-features", "train.datasets=[/nonexistent]"], "does not exist")


def test_distill_refuses_bad_prompts_and_outputs(tmp_path, capsys):
    _refused(capsys, ["distill", "prompts.path=/nonexistent.jsonl"], "prompt file not found")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "hi"}\n')
    _refused(
        capsys, ["distill", f"prompts.path={prompts}", "prompts.instruction_field=prompt"], "prompt"
    )
    _refused(capsys, ["distill", "prompts.path=null"], "no prompts")
    (tmp_path / "afile").write_text("")
    _refused(
        capsys,
        ["distill", f"prompts.path={prompts}", f"distill.output_dir={tmp_path / 'afile'}"],
        "is a file",
    )


def test_export_demo_and_target_refuse_bad_paths(tmp_path, capsys):
    _refused(capsys, ["export", "--head", HEAD], "needs --head DIR --format FORMAT --out DIR")
    _refused(
        capsys,
        ["export", "--head", HEAD, "--format", "vllm", "--out", HEAD],
        "is the head directory itself",
    )
    _refused(capsys, ["export", "--check", str(tmp_path / "none")], "no such directory")
    _refused(capsys, ["demo", f"head_dir={tmp_path}"], "no head at", "headway demo --train")
    _refused(
        capsys,
        ["target", "info", "target.name_or_path=/nonexistent/model.gguf"],
        "GGUF file not found",
    )
    _refused(
        capsys, ["target", "info", "target.name_or_path=./nowhere"], "target path does not exist"
    )


def test_config_values_out_of_range_are_refused(capsys):
    _refused(
        capsys,
        ["generate", "--head", HEAD, "inference.sampling.top_p=2"],
        "top_p=2.0 must be in (0, 1]",
    )
    _refused(capsys, ["train", "head.kind=hydra"], "head.kind='hydra' is not allowed")
    _refused(capsys, ["bench", "--head", HEAD, "inference.engine=fast"], "inference.engine='fast'")


def test_two_bench_runs_in_one_directory_keep_both_results(tmp_path, monkeypatch):
    """By default each run writes bench-DATE-TIME.json (and .md, .png); a second run in the same
    second gets its own name."""
    from headway.checks import bench_output

    monkeypatch.chdir(tmp_path)
    first = bench_output(None, now=0)
    for suffix in (".json", ".md"):
        first.with_suffix(suffix).write_text("first run")
    second = bench_output(None, now=0)
    assert first.name.startswith("bench-") and second != first and second.name.endswith("-2.json")
    second.write_text("second run")
    assert bench_output(None, now=0).name.endswith("-3.json")
    assert (
        first.read_text() == "first run"
        and bench_output(str(tmp_path / "new.json")).name == "new.json"
    )

"""Typed configs: defaults, YAML, overrides, and errors that name the bad key."""

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from headway.config import load_config, save_config
from headway.errors import HeadwayError
from headway.run_config import RunConfig
from tests.helpers import ROOT_DIR


def test_defaults_yaml_and_overrides(tmp_path: Path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(
        "distill:\n  max_new_tokens: 99\n  engine: hf\ntarget:\n  dtype: bfloat16\n"
    )
    cfg = load_config(RunConfig, cfg_file, ["distill.max_new_tokens=7", "prompts.limit=3"])
    assert cfg.distill.max_new_tokens == 7  # the command line wins over the file
    assert cfg.distill.engine == "hf"
    assert cfg.target.dtype == "bfloat16"
    assert cfg.prompts.limit == 3
    assert cfg.distill.batch_size == 32  # default kept


@pytest.mark.parametrize(
    "where,text,expected",
    [
        ("file", "distill:\n  max_new_token: 5\n", "did you mean 'distill.max_new_tokens'"),
        ("file", "distil:\n  max_new_tokens: 5\n", "unknown config key 'distil'"),
        ("cli", "distill.chunksize=3", "did you mean 'distill.chunk_size'"),
        ("cli", "target.colour=red", "unknown config key 'target.colour'"),
    ],
)
def test_unknown_key_is_named(tmp_path: Path, where: str, text: str, expected: str):
    if where == "file":
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(HeadwayError, match=expected) as e:
            load_config(RunConfig, path)
        assert str(path) in str(e.value)
    else:
        with pytest.raises(HeadwayError, match=expected):
            load_config(RunConfig, None, [text])


def test_bad_values_are_named():
    with pytest.raises(HeadwayError, match="distill.max_new_tokens"):
        load_config(RunConfig, None, ["distill.max_new_tokens=lots"])
    with pytest.raises(HeadwayError, match="distill.engine='fast'"):
        load_config(RunConfig, None, ["distill.engine=fast"])
    with pytest.raises(HeadwayError, match="target.dtype='int3'"):
        load_config(RunConfig, None, ["target.dtype=int3"])
    with pytest.raises(HeadwayError, match="not of the form key=value"):
        load_config(RunConfig, None, ["distill.engine"])
    with pytest.raises(HeadwayError, match="config file not found"):
        load_config(RunConfig, "/no/such.yaml")


def test_resolved_config_round_trips(tmp_path: Path):
    cfg = load_config(RunConfig, None, ["distill.seed=5", "prompts.path=x.jsonl"])
    path = save_config(cfg, tmp_path)
    again = load_config(RunConfig, path)
    assert again == cfg
    assert OmegaConf.load(path).distill.seed == 5


def test_shipped_configs_load():
    for path in sorted(ROOT_DIR.joinpath("configs").glob("*.yaml")):
        load_config(RunConfig, path)


def test_overrides_may_follow_options(capsys):
    from headway.cli import main

    assert (
        main(
            [
                "bench",
                "--head",
                "h",
                "inference.max_new_tokens=7",
                "--limit",
                "2",
                "inference.top_k=3",
                "--print-config",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "max_new_tokens: 7" in out and "top_k: 3" in out
    with pytest.raises(SystemExit) as e:
        main(["bench", "--head", "h", "--bogus", "inference.top_k=3"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_recipes_state_only_what_differs_from_the_defaults():
    """Each default is declared once, in its config class: a recipe (configs/*.yaml) that restated
    one would drift from it silently. A recipe may still name its target and its head kind."""
    from headway.demo_config import DemoConfig

    keep = {"head.kind", "target.name_or_path"}
    configs = ROOT_DIR / "configs"
    restated = []
    for path in sorted(configs.glob("*.yaml")):
        schema = DemoConfig if path.name.startswith("demo") else RunConfig
        defaults = OmegaConf.to_container(OmegaConf.structured(schema))
        load_config(schema, path)  # every recipe loads

        def walk(node: dict, default: object, key: str) -> None:
            for k, v in node.items():
                d = default.get(k, KeyError) if isinstance(default, dict) else KeyError
                if isinstance(v, dict):
                    walk(v, d, f"{key}{k}.")
                elif f"{key}{k}" not in keep and d is not KeyError and d == v:
                    restated.append(f"{path.name}: {key}{k}={v!r}")

        walk(yaml.safe_load(path.read_text()), defaults, "")
    assert restated == []

"""Fuzzing the two readers of user files, the prompt loader and the config loader: whatever the
input, they return a valid result or raise HeadwayError (one message), never anything else."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.errors import HeadwayError
from headway.prompts import Conversation, load_conversations
from headway.run_config import RunConfig

# HEADWAY_FUZZ_EXAMPLES=2000 for a longer hunt than CI's.
SETTINGS = settings(
    max_examples=int(os.environ.get("HEADWAY_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "instruction",
        "prompt",
        "turns",
        "conversations",
        "messages",
        "input",
        "system",
        "role",
        "content",
        "from",
        "value",
        "category",
        "x",
    ]
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "gpt", "bot", 3]),
            "content": st.text(max_size=12) | st.integers(),
        }
    ),
    max_size=4,
)
records = st.dictionaries(field_names, json_values | messages | st.text(max_size=30), max_size=4)


def _load(path: Path, **cfg) -> None:
    try:
        convs = load_conversations(PromptConfig(path=str(path), **cfg))
    except HeadwayError as e:
        assert str(e) and "\n" not in str(e).strip()
        return
    assert convs, "an empty selection must be an error, not an empty list"
    for c in convs:
        assert isinstance(c, Conversation) and c.turns
        assert all(isinstance(t, str) and t.strip() for t in c.turns)
        assert c.system is None or isinstance(c.system, str)


@SETTINGS
@given(
    data=st.binary(max_size=300),
    suffix=st.sampled_from([".jsonl", ".json", ".jsonl.gz", ".parquet"]),
)
def test_prompt_files_of_random_bytes(data: bytes, suffix: str):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"p{suffix}"
        path.write_bytes(data)
        _load(path)


@SETTINGS
@given(
    rows=st.lists(records | json_values, max_size=6),
    as_jsonl=st.booleans(),
    offset=st.integers(0, 3),
    limit=st.none() | st.integers(0, 3),
    max_turns=st.integers(0, 2),
    field=st.sampled_from(["auto", "prompt", "none"]),
)
def test_prompt_files_of_random_records(
    rows: list, as_jsonl: bool, offset: int, limit, max_turns: int, field: str
):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("p.jsonl" if as_jsonl else "p.json")
        text = "".join(json.dumps(r) + "\n" for r in rows) if as_jsonl else json.dumps(rows)
        path.write_text(text, encoding="utf-8")
        _load(path, offset=offset, limit=limit, max_turns=max_turns, instruction_field=field)


config_keys = st.sampled_from(
    [
        "target.dtype",
        "target.num_threads",
        "target.trust_remote_code",
        "distill.max_new_tokens",
        "distill.engine",
        "train.lr",
        "train.max_steps",
        "train.datasets",
        "head.kind",
        "head.eagle3.draft_vocab_size",
        "inference.top_k",
        "inference.depth",
        "bench.turns",
        "features.shard_size",
        "train.colour",
        "nothing",
        "train",
        "a.b.c",
    ]
)
config_values = st.one_of(
    st.text(max_size=10),
    st.integers(-5, 10**6).map(str),
    st.sampled_from(
        [
            "[1,2]",
            "[]",
            "null",
            "true",
            "1e-3",
            "${oc.env:HOME}",
            "{a: 1}",
            "'",
            "[",
            "bfloat16",
            "eagle3",
            "-1",
        ]
    ),
)


@SETTINGS
@given(pairs=st.lists(st.tuples(config_keys, config_values), max_size=4))
def test_config_overrides_fuzz(pairs: list):
    try:
        cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in pairs])
    except HeadwayError as e:
        assert str(e)
        return
    assert isinstance(cfg, RunConfig)


@SETTINGS
@given(
    text=st.text(max_size=200)
    | st.builds(
        lambda k, v: f"{k.split('.')[0]}:\n  {k.split('.')[-1]}: {v}\n", config_keys, config_values
    )
)
def test_config_files_fuzz(text: str):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_bytes(text.encode("utf-8", errors="replace"))
        try:
            cfg = load_config(RunConfig, path)
        except HeadwayError as e:
            assert str(e)
            return
        assert isinstance(cfg, RunConfig)

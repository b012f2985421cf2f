"""Prompt readers: every format, the field mapping, and clear errors for bad files."""

import json
from pathlib import Path

import pytest

from headway.data_scripts.config import PromptConfig
from headway.errors import HeadwayError
from headway.prompts import load_conversations, source_hash

RECORDS = [
    {"instruction": "Add the numbers.", "input": "2 and 3"},
    {"instruction": "Name a colour.", "input": ""},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_json_parquet_and_dataset_agree(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    files = [write_jsonl(tmp_path / "p.jsonl", RECORDS)]
    (tmp_path / "p.json").write_text(json.dumps(RECORDS))
    files.append(tmp_path / "p.json")
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "p.parquet")
    files.append(tmp_path / "p.parquet")
    Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "ds"))
    files.append(tmp_path / "ds")
    for f in files:
        convs = load_conversations(PromptConfig(path=str(f)))
        assert [c.turns for c in convs] == [["Add the numbers.\n\n2 and 3"], ["Name a colour."]], f
        assert [c.id for c in convs] == [0, 1]


def test_turns_sharegpt_and_openai_messages(tmp_path: Path):
    f = write_jsonl(tmp_path / "mt.jsonl", [{"turns": ["first?", "second?"], "category": "math"}])
    (conv,) = load_conversations(PromptConfig(path=str(f)))
    assert conv.turns == ["first?", "second?"] and conv.meta == {"category": "math"}
    share = [
        {
            "conversations": [
                {"from": "human", "value": "q1"},
                {"from": "gpt", "value": "old"},
                {"from": "human", "value": "q2"},
            ]
        }
    ]
    (conv,) = load_conversations(PromptConfig(path=str(write_jsonl(tmp_path / "sg.jsonl", share))))
    assert conv.turns == ["q1", "q2"]  # the source's answers are dropped: the target writes its own
    msgs = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
            ]
        }
    ]
    (conv,) = load_conversations(PromptConfig(path=str(write_jsonl(tmp_path / "m.jsonl", msgs))))
    assert conv.turns == ["hi"] and conv.system == "Be brief."


def test_explicit_and_dotted_fields_offset_limit(tmp_path: Path):
    rows = [
        {"q": {"text": f"question {i}"}, "instances": [{"input": f"ctx {i}"}]} for i in range(5)
    ]
    f = write_jsonl(tmp_path / "n.jsonl", rows)
    convs = load_conversations(
        PromptConfig(
            path=str(f),
            instruction_field="q.text",
            input_field="instances.0.input",
            offset=1,
            limit=2,
        )
    )
    assert [c.turns[0] for c in convs] == ["question 1\n\nctx 1", "question 2\n\nctx 2"]
    assert [c.id for c in convs] == [1, 2]


def test_max_turns(tmp_path: Path):
    f = write_jsonl(tmp_path / "mt.jsonl", [{"turns": ["a?", "b?", "c?"]}])
    (conv,) = load_conversations(PromptConfig(path=str(f), max_turns=2))
    assert conv.turns == ["a?", "b?"]


def test_malformed_line_is_named(tmp_path: Path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"instruction": "ok"}\n\n{"instruction": oops}\n')
    with pytest.raises(HeadwayError, match=r"bad.jsonl line 3 is not valid JSON"):
        load_conversations(PromptConfig(path=str(f)))


@pytest.mark.parametrize(
    "content,cfg,expected",
    [
        ("", {}, "holds no records"),
        ('{"foo": "bar"}\n', {}, r"no prompt field found .*\['foo'\].*instruction_field"),
        (
            '{"instruction": "x"}\n',
            {"instruction_field": "prompt"},
            "no prompt text under the configured fields",
        ),
        ('{"instruction": 5}\n', {}, "must be a string"),
        ('{"turns": "x"}\n', {}, "must be a list of strings"),
        ('{"instruction": "x"}\n', {"offset": 5}, "no prompts selected"),
        ("[1, 2]\n", {}, "expected an object"),
    ],
)
def test_bad_prompt_sets(tmp_path: Path, content: str, cfg: dict, expected: str):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(HeadwayError, match=expected):
        load_conversations(PromptConfig(path=str(f), **cfg))


def test_missing_and_unsupported_files(tmp_path: Path):
    with pytest.raises(HeadwayError, match="prompt file not found"):
        load_conversations(PromptConfig(path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(HeadwayError, match="unsupported prompt file type '.csv'"):
        load_conversations(PromptConfig(path=str(tmp_path / "p.csv")))
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(HeadwayError, match="broken.json is not valid JSON"):
        load_conversations(PromptConfig(path=str(tmp_path / "broken.json")))
    with pytest.raises(HeadwayError, match="no prompt file given"):
        load_conversations(PromptConfig(path=None))


def test_source_hash_changes_with_content(tmp_path: Path):
    f = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    h1 = source_hash(f)
    write_jsonl(f, RECORDS[:1])
    assert source_hash(f) != h1

"""Prompt files in, conversations out: jsonl, json, parquet or a saved `datasets` dataset.

Each record becomes a `Conversation`: the user turns the target will answer, and an optional system
prompt. Assistant turns in the source are dropped: the target writes its own (self-distillation).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from headway.data_scripts.config import PromptConfig
from headway.errors import HeadwayError

# Field names tried in order when a mapping field is "auto".
AUTO_INSTRUCTION_FIELDS = ("instruction", "prompt", "question", "query", "text")
AUTO_INPUT_FIELDS = ("input", "context")
AUTO_TURNS_FIELDS = ("turns",)
AUTO_CONVERSATION_FIELDS = ("conversations", "messages")
USER_ROLES = {"user", "human"}
SYSTEM_ROLES = {"system"}
ASSISTANT_ROLES = {"assistant", "gpt", "bot", "model", "chatgpt"}


@dataclass
class Conversation:
    """One prompt record: `turns` are the user messages, answered one by one."""

    id: int
    turns: list[str]
    system: Optional[str] = None
    meta: dict = field(default_factory=dict)


def _get(record: Any, dotted: str) -> Any:
    node = record
    for part in dotted.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
        if node is None:
            return None
    return node


def _read_records(path: Path) -> list[tuple[str, Any]]:
    """(location, record) pairs; the location names the line or index for error messages."""
    if not path.exists():
        raise HeadwayError(f"prompt file not found: {path}")
    if path.is_dir():
        try:
            from datasets import load_from_disk

            ds = load_from_disk(str(path))
        except Exception as e:
            raise HeadwayError(
                f"{path} is a directory but not a dataset saved with datasets.save_to_disk: {e}"
            ) from None
        if hasattr(ds, "keys"):  # a DatasetDict: use its train split, or its only split
            splits = list(ds.keys())
            ds = ds["train"] if "train" in splits else ds[splits[0]]
        return [(f"{path} row {i}", row) for i, row in enumerate(ds)]
    suffix = "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix
    if suffix in (".jsonl", ".jsonl.gz"):
        import gzip

        opener = gzip.open if suffix.endswith(".gz") else open
        out = []
        try:
            with opener(path, "rb") as f:
                for lineno, raw in enumerate(f, start=1):
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise HeadwayError(
                            f"{path} line {lineno} is not valid UTF-8 (byte {e.start}: {e.reason}): "
                            "re-save the file as UTF-8"
                        ) from None
                    if not line.strip():
                        continue
                    try:
                        out.append((f"{path} line {lineno}", json.loads(line)))
                    except (json.JSONDecodeError, RecursionError) as e:
                        msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
                        raise HeadwayError(
                            f"{path} line {lineno} is not valid JSON ({msg}): fix or remove that line"
                        ) from None
        except (OSError, EOFError) as e:  # gzip: not a gzip file, or cut short
            raise HeadwayError(
                f"cannot read {path} ({type(e).__name__}: {e}): is it whole and of its suffix's type?"
            ) from None
        return out
    if suffix == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise HeadwayError(
                f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
            ) from None
        except UnicodeDecodeError as e:
            raise HeadwayError(
                f"{path} is not valid UTF-8 (byte {e.start}: {e.reason}): re-save the file as UTF-8"
            ) from None
        except RecursionError:
            raise HeadwayError(f"{path} is not valid JSON (nested too deeply)") from None
        if isinstance(data, dict):
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise HeadwayError(
                    f"{path} must hold a list of records (or an object with exactly one list)"
                )
            data = lists[0]
        if not isinstance(data, list):
            raise HeadwayError(f"{path} must hold a list of records, not a {type(data).__name__}")
        return [(f"{path} record {i}", r) for i, r in enumerate(data)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise HeadwayError(f"cannot read parquet file {path}: {e}") from None
        return [(f"{path} row {i}", r) for i, r in enumerate(rows)]
    raise HeadwayError(
        f"unsupported prompt file type '{path.suffix}' for {path}: "
        "use .jsonl, .json, .parquet or a datasets directory"
    )


def _resolve(
    field_value: str, candidates: Iterable[str], records: list[tuple[str, Any]]
) -> Optional[str]:
    """An explicit field name as is; "auto" becomes the first candidate present in the first
    records."""
    if field_value == "none":
        return None
    if field_value != "auto":
        return field_value
    for name in candidates:
        if any(isinstance(r, dict) and _get(r, name) is not None for _, r in records[:50]):
            return name
    return None


def _conversation_turns(messages: Any, where: str) -> tuple[list[str], Optional[str]]:
    if not isinstance(messages, list):
        raise HeadwayError(f"{where}: the conversation field must be a list of messages")
    turns, system = [], None
    for m in messages:
        if not isinstance(m, dict):
            raise HeadwayError(
                f"{where}: each message must be an object with role/content (or from/value)"
            )
        role = str(m.get("role", m.get("from", ""))).lower()
        content = m.get("content", m.get("value"))
        if role in USER_ROLES and isinstance(content, str):
            turns.append(content)
        elif role in SYSTEM_ROLES and isinstance(content, str):
            system = content
        elif role not in ASSISTANT_ROLES:
            raise HeadwayError(
                f"{where}: unknown message role '{role}' (expected user/human, assistant/gpt, system)"
            )
    return turns, system


def load_conversations(cfg: PromptConfig) -> list[Conversation]:
    """Read and normalise the prompt file; an empty result or a mapping that matches nothing is an
    error."""
    if cfg.path is None:
        raise HeadwayError(
            "no prompt file given: set prompts.path=FILE (or magpie.num_prompts=N for self-written prompts)"
        )
    path = Path(cfg.path).expanduser()
    records = _read_records(path)
    if not records:
        raise HeadwayError(f"prompt file {path} holds no records")
    for where, record in records:
        if not isinstance(record, dict):
            raise HeadwayError(
                f"{where}: expected an object with fields, got {type(record).__name__}"
            )
    conv_field = _resolve(cfg.conversations_field, AUTO_CONVERSATION_FIELDS, records)
    turns_field = _resolve(cfg.turns_field, AUTO_TURNS_FIELDS, records)
    instr_field = _resolve(cfg.instruction_field, AUTO_INSTRUCTION_FIELDS, records)
    input_field = _resolve(cfg.input_field, AUTO_INPUT_FIELDS, records)
    if input_field == instr_field:
        input_field = None
    system_field = _resolve(cfg.system_field, (), records)
    if not (conv_field or turns_field or instr_field):
        first = records[0][1]
        keys = sorted(first.keys()) if isinstance(first, dict) else type(first).__name__
        raise HeadwayError(
            f"no prompt field found in {path} (record fields: {keys}); "
            "name it with prompts.instruction_field=FIELD (or turns_field / conversations_field)"
        )
    end = None if cfg.limit is None else cfg.offset + cfg.limit
    out: list[Conversation] = []
    for index, (where, record) in enumerate(records[cfg.offset : end], start=cfg.offset):
        system = _get(record, system_field) if system_field else None
        turns: list[str] = []
        if conv_field and _get(record, conv_field) is not None:
            turns, conv_system = _conversation_turns(_get(record, conv_field), where)
            system = system or conv_system
        elif turns_field and _get(record, turns_field) is not None:
            value = _get(record, turns_field)
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise HeadwayError(f"{where}: field '{turns_field}' must be a list of strings")
            turns = list(value)
        elif instr_field and _get(record, instr_field) is not None:
            text = _get(record, instr_field)
            if not isinstance(text, str):
                raise HeadwayError(
                    f"{where}: field '{instr_field}' must be a string, got {type(text).__name__}"
                )
            extra = _get(record, input_field) if input_field else None
            if isinstance(extra, str) and extra.strip():
                text = f"{text}\n\n{extra}"
            turns = [text]
        turns = [t for t in turns if t.strip()]
        if not turns:
            raise HeadwayError(
                f"{where}: no prompt text under the configured fields (instruction={instr_field}, "
                f"turns={turns_field}, conversations={conv_field}); fix the record or the mapping"
            )
        if system is not None and not isinstance(system, str):
            raise HeadwayError(
                f"{where}: the system prompt must be a string, got {type(system).__name__}"
            )
        for text in turns + ([system] if system else []):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise HeadwayError(
                    f"{where}: the text holds an unpaired surrogate escape (e.g. \\ud800), which is not "
                    "valid Unicode: fix the record"
                ) from None
        if cfg.max_turns > 0:
            turns = turns[: cfg.max_turns]
        meta = {k: record[k] for k in ("category", "question_id", "task_id") if k in record}
        out.append(Conversation(id=index, turns=turns, system=system, meta=meta))
    if not out:
        raise HeadwayError(
            f"no prompts selected from {path} (offset={cfg.offset}, limit={cfg.limit}, {len(records)} "
            "records): lower prompts.offset below the record count, or raise prompts.limit"
        )
    return out


def source_hash(path: str | Path) -> str:
    """SHA-256 of the prompt source (a file, or every file of a dataset directory in name order)."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()

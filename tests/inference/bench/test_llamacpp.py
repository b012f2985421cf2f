"""`headway bench` with llama.cpp beside Headway (inference/bench/llamacpp.py), against a stand-in
llama-server: the prompts it is sent are Headway's own token ids, the head reaches it as the GGUF
`headway export --format gguf` writes, its drafting runs a full chain of the head's trained length,
and its tokens, acceptance and equality with its own plain output land in the bench's rows. The real
llama-server is checked by scripts/check_llamacpp.sh."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from headway.checks import check_llamacpp
from headway.config import load_config
from headway.data_scripts.config import PromptConfig
from headway.errors import HeadwayError
from headway.inference.api import SpeculativeDecoder
from headway.inference.bench.run import markdown_table, run_bench
from headway.inference.config import BenchConfig
from headway.kinds.checkpoint import save_head
from headway.run_config import RunConfig
from tests.export.test_export_gguf import (
    BLOCK,
    dflash_head,
    eagle3_head,
    load,
    make_target,
    other_kind,
)

# A llama-server stand-in: /health, and /completion answering greedy-style with a continuation fixed
# by the prompt (the same with a draft or without), counting half of it as accepted drafts when it
# was given one. It logs its arguments and every prompt it is sent.
FAKE = """#!{python}
import json, sys, http.server
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
draft = args[args.index("-md") + 1] if "-md" in args else None
log = {log!r}
with open(log, "a") as f:
    is_gguf = bool(draft) and open(draft, "rb").read(4) == b"GGUF"
    f.write(json.dumps({{"args": args, "draft_is_gguf": is_gguf}}) + "\\n")
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        p, n = req["prompt"], req["n_predict"]
        with open(log, "a") as f:
            rest = {{k: v for k, v in req.items() if k != "prompt"}}
            f.write(json.dumps({{"prompt": p, "draft": bool(draft), "req": rest}}) + "\\n")
        toks = [(p[-1] + 7 * i) % 40 + 5 for i in range(n)]
        self._send({{"tokens": toks, "stop_type": "limit",
                    "timings": {{"predicted_n": n, "draft_n_accepted": n // 2 if draft else 0}}}})
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("llamacpp") / "target")


def fake_server(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "server.log"
    path = tmp_path / "llama-server"
    path.write_text(FAKE.format(python=sys.executable, log=str(log)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path, log


def bench(target_dir: Path, head_dir: Path, tmp_path: Path, server: Path, *extra: str) -> dict:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"turns": [t], "category": c}) + "\n"
            for t, c in [("Hi?", "a"), ("Sum?", "b")]
        )
    )
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    cfg = load_config(
        RunConfig,
        None,
        [
            f"target.name_or_path={target_dir}",
            "target.device=cpu",
            "target.dtype=float32",
            "target.num_threads=1",
            "inference.max_new_tokens=6",
            "bench.baselines=[]",
            f"bench.llamacpp_server={server}",
            f"bench.llamacpp_target={tmp_path / 'target.gguf'}",
            *extra,
        ],
    )
    decoder = SpeculativeDecoder.load(head_dir, cfg)
    return run_bench(decoder, PromptConfig(path=str(prompts)), 6, cfg.bench), decoder


def test_llama_cpp_runs_beside_headway_with_the_exported_head(target_dir, tmp_path: Path):
    t = load(target_dir)
    head_dir = save_head(eagle3_head(t), tmp_path / "head", t.fingerprint)  # ttt_steps=2
    server, log = fake_server(tmp_path)
    result, decoder = bench(target_dir, head_dir, tmp_path, server, "bench.llamacpp_threads=1")
    assert result["methods"] == ["plain", "llamacpp", "llamacpp_head", "speculative"]
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e for e in entries if "args" in e]
    # two servers: the target alone, and the target with the exported head as an EAGLE-3 draft
    plain_args, head_args = sorted((e["args"] for e in starts), key=len)
    assert "-md" not in plain_args and plain_args[plain_args.index("-t") + 1] == "1"
    assert head_args[head_args.index("--spec-type") + 1] == "draft-eagle3"
    assert head_args[head_args.index("--spec-draft-n-max") + 1] == "2"  # the head's trained unroll
    assert head_args[head_args.index("--spec-draft-p-min") + 1] == "0"  # a full chain every step
    assert [e["draft_is_gguf"] for e in starts].count(True) == 1
    # every prompt reached llama.cpp as Headway's own ids, greedy, with Headway's token budget
    warm = decoder.fmt.first_turn("Hello")  # each method's one untimed run
    sent = [e for e in entries if "prompt" in e and e["prompt"] != warm]
    first_turns = [decoder.fmt.first_turn("Hi?"), decoder.fmt.first_turn("Sum?")]
    for draft in (False, True):
        assert sorted(e["prompt"] for e in sent if e["draft"] == draft) == sorted(first_turns)
    assert all(e["req"]["n_predict"] == 6 and e["req"]["temperature"] == 0.0 for e in sent)
    assert not any(e["req"]["cache_prompt"] for e in sent)
    for row in result["per_prompt"]:
        plain, head = row["llamacpp"], row["llamacpp_head"]
        assert plain["tokens"] == head["tokens"] == 6
        assert (
            plain["target_forwards"] == 5 and head["target_forwards"] == 5 - 3
        )  # 3 drafts accepted
        assert head["match"] is True  # equal to llama.cpp's own plain output
    o = result["overall"]
    assert o["tau_by_method"]["llamacpp_head"] == pytest.approx(5 / 2)
    assert o["matches_plain"]["llamacpp_head"] == 1.0
    assert "llama.cpp + head" in markdown_table(result)


def test_a_dflash_head_drafts_its_whole_block_in_llama_cpp(target_dir, tmp_path: Path):
    t = load(target_dir)
    head_dir = save_head(dflash_head(t), tmp_path / "head", t.fingerprint)
    server, log = fake_server(tmp_path)
    result, _ = bench(target_dir, head_dir, tmp_path, server)
    assert result["methods"] == ["plain", "llamacpp", "llamacpp_head", "speculative"]
    starts = [json.loads(line) for line in log.read_text().splitlines() if '"args"' in line]
    head_args = max((e["args"] for e in starts), key=len)
    assert head_args[head_args.index("--spec-type") + 1] == "draft-dflash"
    # the block's mask slots
    assert head_args[head_args.index("--spec-draft-n-max") + 1] == str(BLOCK - 1)


def test_a_kind_llama_cpp_cannot_draft_with_runs_it_plainly(target_dir, tmp_path: Path, caplog):
    t = load(target_dir)
    head_dir = save_head(other_kind(t, "eagle"), tmp_path / "head", t.fingerprint)
    server, log = fake_server(tmp_path)
    with caplog.at_level("WARNING", logger="headway"):
        result, _ = bench(target_dir, head_dir, tmp_path, server)
    assert result["methods"] == ["plain", "llamacpp", "speculative"]
    assert "llama.cpp has no EAGLE-1 drafts" in caplog.text


def test_bench_llamacpp_settings_are_checked_before_anything_loads(tmp_path: Path):
    with pytest.raises(HeadwayError, match="bench.llamacpp_server needs bench.llamacpp_target"):
        BenchConfig(llamacpp_server="llama-server")
    with pytest.raises(HeadwayError, match="bench.llamacpp_server=.* is not an executable"):
        check_llamacpp(
            BenchConfig(llamacpp_server=str(tmp_path / "none"), llamacpp_target="t.gguf")
        )
    server, _ = fake_server(tmp_path)
    with pytest.raises(HeadwayError, match="bench.llamacpp_target=.* is not a file"):
        check_llamacpp(
            BenchConfig(llamacpp_server=str(server), llamacpp_target=str(tmp_path / "x"))
        )

"""llama.cpp beside Headway in `headway bench`: the target's GGUF served by `llama-server`, plainly
and with the head exported as llama.cpp's GGUF (`headway export --format gguf`: EAGLE-3 drafting
with `--spec-type draft-eagle3`, DFlash with `draft-dflash`).

Each prompt goes to the server as Headway's own token ids (the same chat formatting), greedy, with
the same token budget and no prompt cache between requests; its seconds are the request's wall time,
prompt processing included, as Headway counts its own. llama.cpp returns the stop token it stopped
on, as Headway's results keep theirs, so outputs compare token for token. Its acceptance comes from
the server's timings: `draft_n_accepted` drafts accepted over `predicted_n` tokens, each target step
after the prompt's giving its accepted drafts and one token of its own.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import gguf
import torch

from headway.errors import HeadwayError
from headway.export.exporter import draft_tokens, export_head
from headway.export.layouts import LAYOUTS, REFUSED
from headway.export.layouts.gguf import WEIGHTS_FILE
from headway.inference.generate import GenerationResult

log = logging.getLogger("headway")

LLAMACPP, LLAMACPP_HEAD = "llamacpp", "llamacpp_head"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` process on a free local port, for the length of a `with` block.

    Args:
        binary: the llama-server executable.
        model: the target's GGUF file.
        threads: the threads it decodes (and processes prompts) with.
        extra: further arguments (the draft's, for speculative decoding).
        log: where its output goes (a file beside the bench results).
        start_seconds: how long it may take to load before it is given up.
    """

    def __init__(
        self,
        binary: str,
        model: str,
        threads: int,
        extra: tuple[str, ...] = (),
        log: Optional[Path] = None,
        start_seconds: float = 300.0,
    ):
        self.cmd = [binary, "-m", model, "-t", str(threads), "-tb", str(threads)]
        self.cmd += ["-c", "8192", "-np", "1", "--no-webui", *extra]
        self.log, self.start_seconds = log, start_seconds
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    def __enter__(self) -> "LlamaServer":
        self.port = _free_port()
        out = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [*self.cmd, "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.start_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HeadwayError(
                    f"llama-server exited with {self.proc.returncode} while loading "
                    f"(bench.llamacpp_server): see {self.log or 'its output'}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.25)
        self.__exit__(None, None, None)
        raise HeadwayError(f"llama-server did not answer within {self.start_seconds:.0f} s")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, ids: list[int], max_new_tokens: int) -> GenerationResult:
        """Greedy decoding of the prompt `ids`: the new tokens (the stop token kept), target steps
        after the prompt's, and the request's seconds."""
        body = {
            "prompt": ids,
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            reply = json.loads(r.read())
        seconds = time.perf_counter() - start
        tokens = [int(t) for t in reply.get("tokens") or []]
        timings = reply.get("timings", {})
        accepted = int(timings.get("draft_n_accepted", 0))
        steps = max(len(tokens) - 1 - accepted, 0)
        return GenerationResult(tokens, steps, seconds, [], sources={})


def draft_architecture(draft: str) -> str:
    """The GGUF architecture of an exported head (eagle3 or dflash), which names llama-server's
    drafting mode (`--spec-type draft-<architecture>`)."""
    reader = gguf.GGUFReader(draft)
    return str(reader.fields["general.architecture"].contents())


def draft_args(draft: str, draft_tokens: int, threads: int) -> tuple[str, ...]:
    """llama-server's arguments for the exported head: `draft_tokens` drafted in full every step
    (no early stop on the draft's probability; EAGLE-3's chain, DFlash's block's mask slots), as
    Headway's own drafter drafts them."""
    return (
        "-md",
        draft,
        "--spec-type",
        f"draft-{draft_architecture(draft)}",
        "--spec-draft-n-max",
        str(draft_tokens),
        "--spec-draft-n-min",
        "0",
        "--spec-draft-p-min",
        "0",
        "-td",
        str(threads),
    )


def llamacpp_runners(
    decoder: Any, bc: Any, max_new_tokens: int, stack: ExitStack
) -> dict[str, Callable[[list[int]], GenerationResult]]:
    """The llama.cpp methods `headway bench` runs beside Headway's, their servers started on `stack`
    (stopped when it closes): `llamacpp` (plain) and, for a head llama.cpp can draft with,
    `llamacpp_head`; {} without bench.llamacpp_server.

    Args:
        decoder: the bench's SpeculativeDecoder (its head, target and tokenizer).
        bc: the bench section (BenchConfig: llamacpp_server, _target, _draft, _draft_tokens,
            _threads).
        max_new_tokens: the token budget of every method.
        stack: the ExitStack that owns the servers and the exported head's folder.
    """
    if not bc.llamacpp_server:
        return {}
    threads = bc.llamacpp_threads or decoder.cfg.target.num_threads or torch.get_num_threads()
    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="headway-llamacpp-")))
    plain = LlamaServer(bc.llamacpp_server, bc.llamacpp_target, threads, log=work / "plain.log")
    runners = {
        LLAMACPP: partial(stack.enter_context(plain).complete, max_new_tokens=max_new_tokens)
    }
    draft = bc.llamacpp_draft or _exported_head(decoder, work)
    if draft is None:
        return runners
    k = bc.llamacpp_draft_tokens or draft_tokens(decoder.head_config)
    spec = LlamaServer(
        bc.llamacpp_server,
        bc.llamacpp_target,
        threads,
        draft_args(str(draft), k, threads),
        log=work / "head.log",
    )
    runners[LLAMACPP_HEAD] = partial(
        stack.enter_context(spec).complete, max_new_tokens=max_new_tokens
    )
    return runners


def _exported_head(decoder: Any, work: Path) -> Optional[Path]:
    """The bench's head as llama.cpp's GGUF (EAGLE-3, DFlash), or None (with the reason logged) for a
    kind llama.cpp cannot draft with."""
    kind = decoder.head_config.get("kind")
    if "gguf" not in LAYOUTS.get(kind, {}):
        log.warning("llama.cpp runs plainly only: %s", REFUSED.get(kind, {}).get("gguf", kind))
        return None
    if decoder.head_dir is None:
        raise HeadwayError(
            "bench.llamacpp_draft is needed for a decoder not loaded from a head directory"
        )
    out = export_head(
        decoder.head_dir,
        "gguf",
        work / "head",
        target_fingerprint=decoder.target.fingerprint,
        tokenizer=decoder.target.tokenizer,
    )
    return out / WEIGHTS_FILE

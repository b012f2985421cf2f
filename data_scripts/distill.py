"""Self-distillation: the frozen target answers prompts, and its answers become training data.

Work is cut into chunks of prompts; each finished chunk is written atomically, so a killed run
resumes at the first missing chunk with nothing lost or duplicated. Under torchrun each rank takes a
disjoint set of chunks; rank 0 merges them into one `datasets` dataset plus `manifest.json`, which
is written last and marks the dataset complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from tqdm import tqdm

import headway
from headway.config import save_config
from headway.data_scripts.config import MANIFEST, RUN_STATE, DistillConfig, require_finished
from headway.data_scripts.engines import (
    Engine,
    HFEngine,
    SamplingSettings,
    StaticEngine,
    VLLMEngine,
    vllm_available,
)
from headway.data_scripts.magpie import write_prompts
from headway.errors import HeadwayError
from headway.faults import fault_point
from headway.inference.engines.cuda.runner import cuda_supported
from headway.io import (
    atomic_write_json,
    disk_full_named,
    file_checksums,
    read_json,
    verify_checksums,
)
from headway.prompts import Conversation, load_conversations, source_hash
from headway.ranks import DistInfo, dist_info
from headway.runtime import barrier
from headway.target.chat import ChatFormat
from headway.target.loading import Target, load_target

if TYPE_CHECKING:
    from headway.data_scripts.config import MagpieConfig, PromptConfig
    from headway.target.config import TargetConfig

log = logging.getLogger("headway")

CHUNK_DIR = "chunks"


@dataclass
class _State:
    conv: Conversation
    ids: list[int]
    mask: list[int]
    turns_done: int = 0
    finished: bool = True


def _settings(cfg: DistillConfig) -> SamplingSettings:
    return SamplingSettings(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)


def answer(
    convs: list[Conversation],
    fmt: ChatFormat,
    engine: Engine,
    cfg: DistillConfig,
    max_length: int,
    seed: int,
    progress: Any = None,
) -> tuple[list[dict], list[dict]]:
    """Answer every conversation turn by turn (all first turns in one batch, then all second
    turns...).

    Returns (rows, skipped): rows hold input_ids and a loss_mask that is 1 exactly on the target's
        tokens.
    """
    rows, skipped = [], []
    states: list[_State] = []
    for c in convs:
        ids = fmt.first_turn(c.turns[0], c.system)
        if len(ids) + cfg.max_new_tokens > max_length:
            msg = (
                f"prompt {c.id} has {len(ids)} tokens; with "
                f"max_new_tokens={cfg.max_new_tokens} it exceeds max_length={max_length}"
            )
            if cfg.on_too_long == "error":
                raise HeadwayError(
                    f"{msg}: shorten it, raise distill.max_length, or set distill.on_too_long=skip"
                )
            skipped.append({"id": c.id, "reason": "too_long"})
            continue
        states.append(_State(c, ids, [0] * len(ids)))
    settings = _settings(cfg)
    for turn in range(max((len(c.turns) for c in convs), default=0)):
        active = []
        for s in states:
            if turn >= len(s.conv.turns) or s.turns_done < turn:
                continue
            if turn > 0:
                glue = fmt.next_turn(s.conv.turns[turn], s.ids[-1], s.conv.system)
                if len(s.ids) + len(glue) + cfg.max_new_tokens > max_length:
                    continue  # the conversation ends here: later turns do not fit
                s.ids += glue
                s.mask += [0] * len(glue)
            active.append(s)
        if not active:
            break
        gens = engine.generate([s.ids for s in active], settings, seed + turn, progress)
        for s, g in zip(active, gens):
            s.ids += g.token_ids
            s.mask += [1] * len(g.token_ids)
            s.turns_done += 1
            s.finished = s.finished and g.finished
    for s in states:
        rows.append(
            {
                "id": s.conv.id,
                "input_ids": s.ids,
                "loss_mask": s.mask,
                "num_turns": s.turns_done,
                "finished": s.finished,
            }
        )
    return rows, skipped


def _chunk_path(out: Path, k: int) -> Path:
    return out / CHUNK_DIR / f"chunk-{k:06d}.json"


def _chunk_is_whole(out: Path, k: int) -> bool:
    """A chunk file that exists and parses; a damaged one is named and redone."""
    p = _chunk_path(out, k)
    if not p.exists():
        return False
    try:
        data = read_json(p)
        if data.get("chunk") == k and isinstance(data.get("rows"), list):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    log.warning("chunk %s is damaged (not the JSON this run wrote): generating it again", p)
    return False


def engine_name(d: DistillConfig, target: Target) -> str:
    """The engine distill.engine picks for this target: auto is vllm where installed, else static
    for a CUDA target the static engine runs, else hf."""
    if d.engine != "auto":
        return d.engine
    if vllm_available():
        return "vllm"
    model = target.model
    if (
        model is not None
        and next(model.parameters()).device.type == "cuda"
        and cuda_supported(model)
    ):
        return "static"
    return "hf"


def _make_engine(
    name: str, d: DistillConfig, target: Target, max_length: int, trust_remote_code: bool
) -> Engine:
    stop_ids = ChatFormat(target.tokenizer, None, target.generation_config).stop_ids
    if name == "vllm":
        log.info("generation engine: vllm")
        return VLLMEngine(
            str(target.path),
            stop_ids,
            d.vllm_dtype,
            max_length,
            d.vllm_max_num_seqs,
            d.seed,
            target.num_threads,
            trust_remote_code,
        )
    if target.model is None:
        raise HeadwayError("internal: the hf and static engines need the target model loaded")
    if name == "static":
        log.info("generation engine: static (Headway's batched decoder), %d slots", d.batch_size)
        return StaticEngine(target.model, stop_ids, d.batch_size, max_length, d.check_every)
    log.info(
        "generation engine: hf (transformers), batch %d, %s cache",
        d.batch_size,
        d.hf_cache,
    )
    return HFEngine(
        target.model,
        target.tokenizer.pad_token_id,
        stop_ids,
        d.batch_size,
        d.hf_cache,
        d.hf_width_bucket,
    )


def _run_identity(
    prompts: PromptConfig,
    magpie: MagpieConfig,
    d: DistillConfig,
    target: Target,
    source: str,
    total: int,
) -> dict:
    """What must not change between a run and its resumption."""
    return {
        "target_fingerprint": target.fingerprint,
        "prompt_source": source,
        "prompts": asdict(prompts) if prompts.path else None,
        "magpie": asdict(magpie) if not prompts.path else None,
        "generation": {
            "max_new_tokens": d.max_new_tokens,
            "temperature": d.temperature,
            "top_p": d.top_p,
            "top_k": d.top_k,
            "seed": d.seed,
            "max_length": d.max_length,
            "on_too_long": d.on_too_long,
            "system_prompt": d.system_prompt,
        },
        "chunk_size": d.chunk_size,
        "num_prompts": total,
    }


def _check_or_write_identity(out: Path, identity: dict, info: DistInfo) -> None:
    path = out / RUN_STATE
    if path.exists():
        old = read_json(path)
        changed = [k for k in identity if old.get(k) != identity[k]]
        if changed:
            raise HeadwayError(
                f"{out} holds a distillation run with other settings ({', '.join(changed)} changed): "
                "use a new distill.output_dir, or delete that directory to start over"
            )
    elif info.is_main:
        atomic_write_json(path, identity)


def distill(
    target_cfg: TargetConfig, prompts: PromptConfig, d: DistillConfig, magpie: MagpieConfig
) -> Path:
    """Run (or resume) self-distillation; returns the dataset directory.

    Args:
        target_cfg: the target that answers (the `target` section).
        prompts: the prompt file (the `prompts` section); with no path, the target writes its own
            prompts.
        d: generation and output settings (the `distill` section). `chunk_size=0` is resolved in
            place.
        magpie: how the target writes its own prompts when `prompts.path` is empty (the `magpie`
            section).

    Returns:
        `d.output_dir`, holding a finished dataset (manifest.json written last).
    """
    info = dist_info()
    out = Path(d.output_dir).expanduser()
    if (out / MANIFEST).exists():
        log.info("%s is already complete (manifest.json present)", out)
        return out
    if info.world_size > 1:
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():  # gloo: only barriers are needed, on CPU or GPU alike
            dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
    use_vllm = d.engine == "vllm" or (d.engine == "auto" and vllm_available())
    target = load_target(target_cfg, with_model=not use_vllm)
    name = engine_name(d, target)
    if d.chunk_size == 0:
        d.chunk_size = {"vllm": d.vllm_max_num_seqs, "static": 4 * d.batch_size}.get(
            name, d.batch_size
        )
    max_length = min(d.max_length or target.max_position_embeddings, target.max_position_embeddings)
    fmt = ChatFormat(target.tokenizer, d.system_prompt, target.generation_config)

    if prompts.path:
        convs: Optional[list[Conversation]] = load_conversations(prompts)
        total = len(convs)
        source = f"file:{prompts.path} sha256:{source_hash(prompts.path)}"
    elif magpie.num_prompts > 0:
        convs, total, source = None, magpie.num_prompts, "magpie"
    else:
        raise HeadwayError(
            "no prompts: set prompts.path=FILE, or magpie.num_prompts=N to let the target write its own"
        )

    out.mkdir(parents=True, exist_ok=True)
    identity = _run_identity(prompts, magpie, d, target, source, total)
    if info.is_main:
        _check_or_write_identity(out, identity, info)
        save_config({"target": target_cfg, "prompts": prompts, "distill": d, "magpie": magpie}, out)
    barrier(info)
    if not info.is_main:
        _check_or_write_identity(out, identity, info)

    cs = d.chunk_size
    num_chunks = (total + cs - 1) // cs
    mine = [k for k in range(num_chunks) if k % info.world_size == info.rank]
    todo = [k for k in mine if not _chunk_is_whole(out, k)]
    my_total = sum(min(cs, total - k * cs) for k in mine)
    done = my_total - sum(min(cs, total - k * cs) for k in todo)
    if done:
        log.info("resuming: %d of %d chunks already written", len(mine) - len(todo), len(mine))
    engine = _make_engine(name, d, target, max_length, target_cfg.trust_remote_code)
    bar = tqdm(
        total=my_total,
        initial=done,
        desc=f"distill[rank {info.rank}]" if info.world_size > 1 else "distill",
        unit="prompt",
        position=info.rank,
    )
    stats = {"tokens": 0, "start": time.time()}

    def progress(new_tokens: int) -> None:
        stats["tokens"] += new_tokens
        bar.set_postfix(tok_s=f"{stats['tokens'] / max(1e-9, time.time() - stats['start']):.0f}")

    for k in todo:
        lo, hi = k * cs, min(total, (k + 1) * cs)
        seed = d.seed + 1000 * k
        skipped: list[dict] = []
        if convs is not None:
            chunk = convs[lo:hi]
        else:
            texts = write_prompts(engine, fmt, magpie, hi - lo, seed, progress)
            chunk = [
                Conversation(id=lo + j, turns=[t]) for j, t in enumerate(texts) if t is not None
            ]
            skipped = [
                {"id": lo + j, "reason": "magpie_rejected"}
                for j, t in enumerate(texts)
                if t is None
            ]
        rows, too_long = answer(chunk, fmt, engine, d, max_length, seed + 1, progress)
        atomic_write_json(
            _chunk_path(out, k),
            {"chunk": k, "ids": [lo, hi], "rows": rows, "skipped": skipped + too_long},
        )
        fault_point(f"distill:chunk:{k}")
        bar.update(hi - lo)
    bar.close()
    elapsed = time.time() - stats["start"]
    barrier(info)
    if info.is_main:
        expected = [c.id for c in convs] if convs is not None else list(range(total))
        batch = d.vllm_max_num_seqs if name == "vllm" else d.batch_size
        _merge(out, num_chunks, expected, identity, engine.name, stats["tokens"], elapsed, batch)
    barrier(info)
    if info.world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def _merge(
    out: Path,
    num_chunks: int,
    expected: list[int],
    identity: dict,
    engine: str,
    tokens: int,
    elapsed: float,
    batch: int,
) -> None:
    """Join the chunk files into one dataset; every prompt id (`expected`: the prompt file's record
    indices, from prompts.offset, or 0..N-1 for Magpie) must appear exactly once."""
    from datasets import Dataset, Features, Sequence, Value

    rows: list[dict] = []
    skipped: list[dict] = []
    for k in range(num_chunks):
        p = _chunk_path(out, k)
        if not p.exists():
            raise HeadwayError(
                f"chunk {p.name} is missing after all ranks finished: rerun the same command to fill it"
            )
        data = read_json(p)
        rows += data["rows"]
        skipped += data["skipped"]
    seen = [r["id"] for r in rows] + [s["id"] for s in skipped]
    if sorted(seen) != expected:
        raise HeadwayError(
            f"chunks in {out / CHUNK_DIR} do not cover every prompt exactly once: delete {out} and rerun"
        )
    if not rows:
        reasons = sorted({s["reason"] for s in skipped})
        raise HeadwayError(
            f"no samples: all {len(expected)} prompts were skipped ({', '.join(reasons)}); see "
            "distill.on_too_long, distill.max_length and the magpie settings"
        )
    rows.sort(key=lambda r: r["id"])
    features = Features(
        {
            "id": Value("int64"),
            "input_ids": Sequence(Value("int32")),
            "loss_mask": Sequence(Value("int8")),
            "num_turns": Value("int32"),
            "finished": Value("bool"),
        }
    )
    columns = {name: [r[name] for r in rows] for name in features}
    ds = Dataset.from_dict(columns, features=features)
    tmp = out / ".merge-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with disk_full_named(tmp):
        ds.save_to_disk(str(tmp))
    for old in list(out.glob("data-*.arrow")) + [out / "state.json", out / "dataset_info.json"]:
        if old.exists():
            old.unlink()
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    fault_point("distill:merged")
    gen_tokens = sum(sum(r["loss_mask"]) for r in rows)
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    manifest = {
        "headway_version": headway.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **identity,
        "engine": engine,
        "counts": {
            "prompts": len(expected),
            "samples": len(rows),
            "skipped": reasons,
            "tokens": sum(len(r["input_ids"]) for r in rows),
            "generated_tokens": gen_tokens,
            "unfinished_samples": sum(1 for r in rows if not r["finished"]),
        },
        # this run's generation only: a rerun that found every chunk written generated nothing
        # (None, not 0)
        "rank0_throughput_tok_s": round(tokens / elapsed, 1)
        if elapsed > 0 and tokens > 0
        else None,
        # the sequences the engine decoded together (hf: per generate call; static: slots; vllm: at
        # most)
        "engine_batch_size": batch,
        "files": file_checksums(
            out,
            [
                f.name
                for f in out.iterdir()
                if f.is_file()
                and f.name not in (MANIFEST, RUN_STATE)
                and not f.name.startswith(".")
                and f.name != "config.yaml"
            ],
        ),
    }
    atomic_write_json(out / MANIFEST, manifest)
    log.info("wrote %d samples (%d generated tokens) to %s", len(rows), gen_tokens, out)


def load_distilled(path: str | os.PathLike) -> tuple[Any, dict]:
    """A finished self-distilled dataset and its manifest; an unfinished one is refused."""
    from datasets import load_from_disk

    p = Path(path)
    require_finished(p)
    manifest = json.loads((p / MANIFEST).read_text())
    verify_checksums(
        p,
        manifest.get("files"),
        "dataset",
        "the file is damaged; delete manifest.json and rerun the same "
        "`headway distill` to rebuild the dataset from its chunks",
    )
    return load_from_disk(str(p)), manifest

"""Every command's inputs, checked before it loads torch, a model or a kernel.

A mistake in a path, a prompt file, a dataset or a head directory costs the user the seconds to
minutes a command spends loading the target and building its kernels before it reads its inputs. The
command line runs the check for its command first (`headway/cli.py`), so each mistake comes back at
once, as one message that names the thing and the fix. Everything here is torch-free; the commands
still check again where they read (a dataset's checksums, a head's target fingerprint), since those
need the data or the target.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from headway.data_scripts.config import MANIFEST, PromptConfig, require_finished
from headway.errors import HeadwayError
from headway.io import read_json
from headway.kinds.config import kind_names
from headway.kinds.head_dir import read_head_config, resolve_head_dir
from headway.prompts import load_conversations
from headway.run_config import RunConfig
from headway.target.config import ALIASES, TargetConfig
from headway.target.families import choose_engine


def check_prompts(cfg: PromptConfig, setting: str = "prompts.path") -> int:
    """Parse the whole prompt file as the command will (fields, turns, offset and limit); returns
    how many conversations it holds. The first bad line is named with its number."""
    if not cfg.path:
        raise HeadwayError(f"no prompt file given: set {setting}=FILE")
    return len(load_conversations(cfg))


def check_target(cfg: TargetConfig) -> None:
    """target.name_or_path names something that can exist here: an alias, a local file or directory,
    or a hub id (`org/name`, looked up in the local cache when the target loads)."""
    name = cfg.name_or_path
    if name in ALIASES:
        return
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and not path.is_file():
        raise HeadwayError(f"target GGUF file not found: {path} (target.name_or_path)")
    if path.is_dir() and cfg.gguf_file and not (path / cfg.gguf_file).is_file():
        raise HeadwayError(f"target.gguf_file '{cfg.gguf_file}' not found in {path}")
    if not path.exists() and (name.startswith(("/", ".", "~")) or name.count("/") != 1):
        raise HeadwayError(
            f"target path does not exist: {name} (target.name_or_path: a local model directory, "
            f"a .gguf file, a hub id in the local cache, or one of {', '.join(ALIASES)})"
        )


def check_writable(path: str | os.PathLike, setting: str) -> Path:
    """`path` is (or can be made) a directory this process writes into: it, or its nearest existing
    parent, is a writable directory."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise HeadwayError(f"{setting}={p} is a file, not a directory: choose a directory")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise HeadwayError(
            f"{setting}={p}: {existing} is a file, not a directory: choose another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise HeadwayError(
            f"{setting}={p}: cannot write in {existing} (permission denied): choose a directory you can write"
        )
    return p


def check_file_parent(path: str | os.PathLike, setting: str) -> None:
    """An output file's directory can be written (the file itself is replaced atomically)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise HeadwayError(f"{setting} {p} is a directory: give a file name")
    check_writable(p.parent, setting)


# the files a `headway bench` result is: its JSON, and beside it a Markdown table and a PNG plot
BENCH_SUFFIXES = (".json", ".md", ".png")


def bench_output(out: Optional[str], now: Optional[float] = None) -> Path:
    """Where `headway bench` writes, never over a result it did not make: --out if none of its files
    exist (else an error naming them), or by default bench-YYYYmmdd-HHMMSS.json in the working
    directory, with -2, -3 ... added while that name's files exist."""
    if out:
        p = Path(out).expanduser()
        taken = [str(p.with_suffix(x)) for x in BENCH_SUFFIXES if p.with_suffix(x).exists()]
        if taken:
            raise HeadwayError(
                f"--out {p}: {', '.join(taken)} already exist (an earlier result): name another file, or "
                "delete them"
            )
        return p
    import time

    stem = "bench-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    p, n = Path(f"{stem}.json"), 1
    while any(p.with_suffix(x).exists() for x in BENCH_SUFFIXES):
        n += 1
        p = Path(f"{stem}-{n}.json")
    return p


def check_head(path: Optional[str], setting: str = "--head", run_dir: bool = True) -> dict:
    """A head directory with its config, weights and a known kind (`run_dir`: or a training run's
    directory, whose head/ is used); returns its config.json."""
    if not path:
        raise HeadwayError(f"{setting} is required: a head directory written by `headway train`")
    p = Path(path).expanduser()
    p = resolve_head_dir(p) if run_dir else p
    if not p.exists():
        raise HeadwayError(
            f"{setting} {p} does not exist: give a head directory written by `headway train`"
        )
    config = read_head_config(p)
    if not isinstance(config, dict) or config.get("kind") not in kind_names():
        kind = config.get("kind") if isinstance(config, dict) else None
        raise HeadwayError(
            f"{p / 'config.json'} names head kind {kind!r}, which this headway does not know "
            f"({', '.join(kind_names())}): is it a head directory written by `headway train`?"
        )
    return config


def check_datasets(paths: Sequence[str], setting: str) -> list[dict]:
    """Each path is a finished `headway distill` dataset, and all were made by the same target;
    returns their manifests. (Their checksums are verified where training reads them.)"""
    manifests = []
    for path in paths:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise HeadwayError(
                f"{setting}: dataset {p} does not exist: make it with `headway distill`"
            )
        require_finished(p)
        manifest = _read_json(p / MANIFEST, "rerun the same `headway distill` to rewrite it")
        if not isinstance(manifest.get("target_fingerprint"), dict):
            raise HeadwayError(
                f"{p / MANIFEST} has no target fingerprint: it is not a manifest `headway distill` wrote"
            )
        manifests.append(manifest)
    _same_target(list(paths), [m["target_fingerprint"] for m in manifests], "dataset")
    return manifests


def check_feature_caches(
    paths: Sequence[str], datasets: Sequence[str], max_length: int, fingerprint: dict
) -> None:
    """Each feature cache is finished, cached with train.max_length, by the datasets' target, and
    together they hold every training dataset."""
    cached: list[str] = []
    for path in paths:
        p = Path(path).expanduser()
        if not (p / "manifest.json").is_file():
            raise HeadwayError(
                f"train.features_dir: {p} has no manifest.json: "
                "run `headway cache-features` to completion first"
            )
        m = _read_json(p / "manifest.json", "rerun `headway cache-features` to rewrite it")
        if m.get("max_length") != max_length:
            raise HeadwayError(
                f"features in {p} were cached with max_length={m.get('max_length')}, but training has "
                f"train.max_length={max_length}: use the same, or cache them again"
            )
        cached_by = m.get("target_fingerprint") or {}
        diff = [k for k in fingerprint if k != "id" and cached_by.get(k) != fingerprint.get(k)]
        if diff:
            raise HeadwayError(
                f"features in {p} were cached from another target than train.datasets' (differs in "
                f"{', '.join(diff)}): cache them again"
            )
        cached += list(m.get("datasets", []))
    missing = [d for d in datasets if d not in cached]
    if missing:
        raise HeadwayError(
            f"features in {', '.join(map(str, paths))} were cached from {cached}, not from {missing}: "
            "cache them from every dataset you train on (training on a subset of the cached ones is fine)"
        )


def before_distill(cfg: RunConfig) -> None:
    check_target(cfg.target)
    out = check_writable(cfg.distill.output_dir, "distill.output_dir")
    if (out / MANIFEST).is_file():
        return  # already complete: distill returns it as it is
    if cfg.prompts.path:
        check_prompts(cfg.prompts)
    elif cfg.magpie.num_prompts <= 0:
        raise HeadwayError(
            "no prompts: set prompts.path=FILE, or magpie.num_prompts=N to let the target write its own"
        )


def before_cache_features(cfg: RunConfig) -> None:
    check_target(cfg.target)
    if not cfg.train.datasets:
        raise HeadwayError(
            "no datasets: set train.datasets=[DIR, ...] (directories written by `headway distill`)"
        )
    check_datasets(cfg.train.datasets, "train.datasets")
    check_writable(cfg.features.output_dir, "features.output_dir")


def before_train(cfg: RunConfig) -> None:
    tc = cfg.train
    check_target(cfg.target)
    if not tc.datasets:
        raise HeadwayError(
            "no training data: set train.datasets=[DIR, ...] (directories written by `headway distill`)"
        )
    manifests = check_datasets(tc.datasets, "train.datasets")
    if tc.eval_datasets:  # (TrainConfig refuses evaluation data that also trains)
        evals = check_datasets(tc.eval_datasets, "train.eval_datasets")
        _same_target(
            [tc.datasets[0], tc.eval_datasets[0]],
            [manifests[0]["target_fingerprint"], evals[0]["target_fingerprint"]],
            "dataset",
        )
    if tc.features_dir:
        check_feature_caches(
            tc.features_dir, tc.datasets, tc.max_length, manifests[0]["target_fingerprint"]
        )
    if tc.init_from:
        check_head(tc.init_from, "train.init_from", run_dir=False)
    check_writable(tc.output_dir, "train.output_dir")


def before_export(args: Any) -> None:
    if args.check:
        if not Path(args.check).expanduser().is_dir():
            raise HeadwayError(
                f"--check {args.check}: no such directory (an export written by `headway export`)"
            )
        return
    if not (args.head and args.format and args.out):
        raise HeadwayError(
            "headway export needs --head DIR --format FORMAT --out DIR (or --check DIR)"
        )
    check_head(args.head)
    out = Path(args.out).expanduser()
    if out.resolve() == resolve_head_dir(Path(args.head).expanduser()).resolve():
        raise HeadwayError(f"--out {out} is the head directory itself: choose another directory")
    check_writable(out, "--out")


def check_family(cfg: RunConfig) -> None:
    """A target whose family speculative decoding cannot verify (a recurrent state), or an engine
    asked for that cannot run its family: one line, from its config.json (target/families.py),
    before torch loads."""
    config = Path(cfg.target.name_or_path).expanduser() / "config.json"
    if config.is_file():
        choose_engine(
            _read_json(config, "target.name_or_path needs a Hugging Face model config"),
            cfg.inference.engine,
            False,
        )


def before_decoding(cfg: RunConfig, head: str) -> None:
    """generate, bench and tune: the target, its family and the head."""
    check_target(cfg.target)
    check_family(cfg)
    check_head(head)


def bench_prompts(cfg: RunConfig, args: Any) -> PromptConfig:
    """The prompt set `headway bench` reads: --prompts and --limit over the prompts section."""
    prompts = dataclasses.replace(
        cfg.prompts,
        path=args.prompts or cfg.prompts.path,
        limit=args.limit if args.limit is not None else cfg.prompts.limit,
    )
    if not prompts.path:
        raise HeadwayError(
            "headway bench needs prompts: --prompts FILE (jsonl with a `turns` or `prompt` field)"
        )
    return prompts


def check_llamacpp(bc: Any) -> None:
    """bench.llamacpp_*: llama-server runs here, and the GGUF files it is given exist."""
    if not bc.llamacpp_server:
        return
    server = shutil.which(bc.llamacpp_server)
    if server is None:
        raise HeadwayError(
            f"bench.llamacpp_server={bc.llamacpp_server} is not an executable: give the path of "
            "llama.cpp's llama-server (scripts/check_llamacpp.sh builds one)"
        )
    for key in ("llamacpp_target", "llamacpp_draft"):
        path = getattr(bc, key)
        if path and not Path(path).expanduser().is_file():
            raise HeadwayError(f"bench.{key}={path} is not a file: give a GGUF file's path")


def before_bench(cfg: RunConfig, args: Any) -> PromptConfig:
    before_decoding(cfg, args.head)
    check_llamacpp(cfg.bench)
    prompts = bench_prompts(cfg, args)
    check_prompts(prompts, "--prompts")
    args.out = str(bench_output(args.out))
    check_file_parent(args.out, "--out")
    return prompts


def before_tune(cfg: RunConfig, head: str) -> None:
    before_decoding(cfg, head)
    if cfg.tune.prompts:
        check_prompts(PromptConfig(path=cfg.tune.prompts), "tune.prompts")


def before_demo(cfg: Any, train_first: bool) -> None:
    check_target(cfg.target)
    if cfg.head_dir and not train_first:
        if not (Path(cfg.head_dir).expanduser() / "model.safetensors").is_file():
            raise HeadwayError(
                f"no head at {cfg.head_dir}: pass head_dir=DIR, or run `headway demo --train` to make one"
            )
        check_head(cfg.head_dir, "head_dir", run_dir=False)
    check_writable(cfg.output_dir, "output_dir")


def _read_json(path: Path, fix: str) -> dict:
    try:
        data = read_json(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadwayError(f"{path} cannot be read as JSON ({e}): {fix}") from None
    if not isinstance(data, dict):
        raise HeadwayError(f"{path} holds a {type(data).__name__}, not a JSON object: {fix}")
    return data


def _same_target(paths: list[str], fingerprints: list[dict], what: str) -> None:
    """All fingerprints agree ('id' aside, as the loaders compare them); else name the first pair
    that differs."""
    first = fingerprints[0]
    for path, fp in zip(paths[1:], fingerprints[1:]):
        diff = [k for k in first if k != "id" and first.get(k) != fp.get(k)]
        if diff:
            raise HeadwayError(
                f"{what} {path} was made by another target than {paths[0]} (differs in {', '.join(diff)}): "
                "use data made by one target"
            )

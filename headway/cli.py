"""The `headway` command: one subcommand per job, each driven by a typed config plus key=value
overrides.

It answers at once: parsing the arguments, loading and checking the config, and checking every input
a command reads (headway/checks.py) need neither torch nor transformers. Each command imports its
job's modules only when it runs, after those checks, so `--help`, `--version`, `--print-config` and
every argument, config or input error come back in well under a second, before any model loads or
kernel builds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from headway import __version__, checks
from headway.config import config_to_yaml, load_config
from headway.demo_config import DemoConfig, demo_config_file
from headway.errors import HeadwayError
from headway.inference.config import TREE_KEYS
from headway.ranks import dist_info
from headway.run_config import RunConfig

log = logging.getLogger("headway")


def _setup_logging(verbose: bool) -> None:
    """INFO from one process; under a launcher, the other ranks only warn (and name their rank)."""

    info = dist_info()
    level = logging.DEBUG if verbose else logging.INFO if info.is_main else logging.WARNING
    tag = f"headway rank {info.rank}" if info.world_size > 1 else "headway"
    logging.basicConfig(level=level, format=f"%(asctime)s [{tag}] %(message)s", datefmt="%H:%M:%S")
    # transformers reads its verbosity when it is first imported, which only a command that needs it
    # does
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _add_config_args(
    p: argparse.ArgumentParser,
    schema: type,
    run: Callable[[Any, argparse.Namespace], int],
    default_config: Optional[str] = None,
) -> None:
    p.set_defaults(schema=schema, run=run)
    p.add_argument(
        "--config",
        default=default_config,
        help="YAML run config (see configs/)"
        + (f"; default {default_config}" if default_config else ""),
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. distill.max_new_tokens=128",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def cmd_distill(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.before_distill(cfg)
    if args.nproc and args.nproc > 1:
        return launch(args.nproc, "distill", cfg, args)
    from headway.data_scripts.distill import distill

    out = distill(cfg.target, cfg.prompts, cfg.distill, cfg.magpie)
    if not dist_info().is_main:
        return 0
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    print(
        f"dataset: {out}  samples={counts['samples']} "
        f"generated_tokens={counts['generated_tokens']} skipped={counts['skipped']}"
    )
    return 0


def cmd_cache_features(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.before_cache_features(cfg)
    if args.nproc and args.nproc > 1:
        return launch(args.nproc, "cache-features", cfg, args)
    from headway.train.feature_cache import run_cache_features

    out = run_cache_features(
        cfg.target, cfg.head, cfg.features, cfg.train.datasets, cfg.train.max_length
    )
    if not dist_info().is_main:
        return 0
    print(f"features: {out}  (train with train.features_dir=[{out}])")
    return 0


def launcher_command(nproc: int, command: str, backend: str, args: argparse.Namespace) -> list[str]:
    """The launcher for `--nproc N` on this machine: deepspeed's for train.backend=deepspeed,
    torchrun otherwise; it reruns the same headway command (minus --nproc) in every process."""
    if command == "train" and backend == "deepspeed":
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(nproc),
            "--no_local_rank",
            "--master_port",
            str(_free_port()),
            "--module",
            "headway",
            command,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "headway",
            command,
        ]
    if args.config:
        cmd += ["--config", str(args.config)]
    return cmd + list(args.overrides or [])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, command: str, cfg: RunConfig, args: argparse.Namespace) -> int:
    """`--nproc N`: start N processes of `command` on this machine (training: for the
    configured train.backend)."""
    import os
    import subprocess

    if command == "train" and cfg.train.backend == "none":
        raise HeadwayError(
            f"--nproc {nproc} needs a distributed train.backend: add train.backend=ddp, fsdp or deepspeed"
        )
    env = dict(os.environ)
    if command == "train" and cfg.train.backend == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise HeadwayError(
                "train.backend=deepspeed needs DeepSpeed: pip install 'headway[deepspeed]'"
            )
        if cfg.target.device == "cpu" or not _cuda_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = launcher_command(nproc, command, cfg.train.backend, args)
    print(f"launching {nproc} processes: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_train(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.before_train(cfg)
    if args.nproc and args.nproc > 1:
        return launch(args.nproc, "train", cfg, args)
    from headway.train.loop import train

    head = train(cfg)
    if dist_info().is_main:
        print(f"head: {head}")
    return 0


def cmd_export(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.before_export(args)
    from headway.export.exporter import export_head, needs_target_lm_head, read_export, serve_hint
    from headway.kinds.checkpoint import check_head_shapes
    from headway.kinds.head_dir import read_head_config, resolve_head_dir
    from headway.target.loading import load_target, target_sizes

    if args.check:
        fmt, config, tensors = read_export(args.check)
        print(
            f"{args.check}: a valid {fmt} export of a "
            f"{config['headway']['kind']} head ({len(tensors)} tensors)"
        )
        return 0
    head = resolve_head_dir(args.head)
    check_head_shapes(head, target_sizes(cfg.target))  # (before the target loads)
    with_model = args.format != "native" and needs_target_lm_head(read_head_config(head))
    target = load_target(cfg.target, with_model=with_model)
    lm_head = target.model.get_output_embeddings().weight if with_model else None
    verifier = args.verifier or ""
    if args.format == "speculators" and not verifier:
        if not Path(cfg.target.name_or_path).expanduser().is_dir():
            raise HeadwayError(
                "--format speculators names the target vLLM serves with the draft: pass --verifier "
                "TARGET_DIR (a Hugging Face directory or hub id; `headway target export --out DIR` "
                f"writes one for {cfg.target.name_or_path})"
            )
        verifier = str(Path(cfg.target.name_or_path).expanduser().resolve())
    out = export_head(
        head,
        args.format,
        args.out,
        args.dtype,
        target.fingerprint,
        lm_head,
        verifier=verifier,
        num_draft_tokens=args.draft_tokens,
        # llama.cpp loads it with the draft
        tokenizer=target.tokenizer if args.format == "gguf" else None,
    )
    config = json.loads((out / "config.json").read_text())
    print(f"exported: {out}  ({args.format})")
    if "headway" in config:
        print(f"serve it: {serve_hint(args.format, config, out)}")
    return 0


def cmd_generate(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.before_decoding(cfg, args.head)
    from headway.inference.api import SpeculativeDecoder

    _explicit_tree(cfg, args)
    decoder = SpeculativeDecoder.load(args.head, cfg)
    prompts = args.prompt or ["Write a short story about a robot who learns to paint."]
    for prompt in prompts:
        r = decoder.chat(prompt)
        print(f"\n== {prompt}\n{r.text}")
        line = f"-- tau {r.spec.tau:.2f}  {r.spec.tokens_per_second:.1f} tok/s ({len(r.spec.tokens)} tokens)"
        if r.plain is not None:
            line += f"  plain {r.plain.tokens_per_second:.1f} tok/s  speedup {r.speedup:.2f}x  "
            if cfg.inference.sampling.greedy:
                line += f"identical to plain greedy: {r.plain.tokens == r.spec.tokens}"
            else:
                line += (
                    f"sampled at T={cfg.inference.sampling.temperature} "
                    "(same distribution as plain, not the same text)"
                )
        print(line)
    return 0


def cmd_bench(cfg: RunConfig, args: argparse.Namespace) -> int:
    prompts = checks.before_bench(cfg, args)
    from headway.inference.api import SpeculativeDecoder
    from headway.inference.bench.run import markdown_table, run_bench, write_results

    cfg.inference.compare_plain = False
    if args.per_category is not None:
        cfg.bench.per_category = args.per_category
    if args.turns is not None:
        cfg.bench.turns = args.turns
    _explicit_tree(cfg, args)
    decoder = SpeculativeDecoder.load(args.head, cfg)
    result = run_bench(decoder, prompts, cfg.inference.max_new_tokens, cfg.bench)
    out = Path(args.out)
    written = write_results(result, out, cfg.bench.plot)
    print(markdown_table(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _explicit_tree(cfg: RunConfig, args: argparse.Namespace) -> None:
    """A tree set on the command line wins over the head's tuned tree."""

    given = [o.split("=", 1)[0] for o in getattr(args, "overrides", None) or []]
    if any(k in (f"inference.{t}" for t in TREE_KEYS) for k in given):
        cfg.inference.use_tuned = False


def cmd_tune(cfg: RunConfig, args: argparse.Namespace) -> int:
    if args.prompts:
        cfg.tune.prompts = args.prompts
    checks.before_tune(cfg, args.head)
    from headway.inference.tune.run import tune

    entry = tune(args.head, cfg)
    chosen = entry["chosen"]
    print("\nbest settings on this machine (expected tokens/s from measured costs and acceptance):")
    print("| settings | draft nodes | expected tau | verify ms | draft ms | expected tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in entry["top_candidates"][:8]:
        print(
            f"| {_settings_text(c['inference'])} | {c['draft_nodes']} | {c['expected_tau']:.2f} "
            f"| {c['verify_ms']:.1f} | {c['draft_ms']:.1f} | {c['tok_s']:.1f} |"
        )
    print(f"plain decoding, expected: {entry['plain_tok_s_estimate']:.1f} tok/s")
    v = entry.get("validation")
    if v:
        print(
            f"\nmeasured on the calibration prompts: plain {v['plain']['tok_s']:.1f} tok/s, configured tree "
            f"{v['configured']['tok_s']:.1f} tok/s (tau {v['configured']['tau']:.2f}), tuned tree "
            f"{v['tuned']['tok_s']:.1f} tok/s (tau {v['tuned']['tau']:.2f}): tuned/configured "
            f"{v['tuned_over_configured']:.2f}x, tuned/plain {v['tuned_over_plain']:.2f}x; outputs equal to "
            f"plain: configured {v['configured']['matches_plain']:.0%}, tuned "
            f"{v['tuned']['matches_plain']:.0%}"
        )
    print(
        f"chosen: {_settings_text(chosen['inference'])} -> saved in {args.head}/tuned.json "
        "(used by generate and bench on this machine)"
    )
    return 0


def _settings_text(s: dict) -> str:
    if "tree" in s:
        return f"Medusa tree of {len(s['tree'])} nodes"
    return f"depth={s['depth']} top_k={s['top_k']} total_tokens={s['total_tokens']}"


def cmd_demo(cfg: DemoConfig, args: argparse.Namespace) -> int:
    checks.before_demo(cfg, args.train)
    from headway.demo import run_demo

    result = run_demo(cfg, train_first=args.train)
    if cfg.inference.sampling.greedy and not result["overall"]["all_equal_plain"]:
        print(
            "headway: error: a speculative output differed from plain greedy decoding",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_target_info(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.check_target(cfg.target)
    from headway.target.loading import load_target

    target = load_target(cfg.target, with_model=False)
    print(json.dumps({"path": str(target.path), "fingerprint": target.fingerprint}, indent=2))
    return 0


def cmd_target_export(cfg: RunConfig, args: argparse.Namespace) -> int:
    checks.check_target(cfg.target)
    checks.check_writable(args.out, "--out")
    from headway.target.loading import export_target, load_target

    cfg.target.device = "cpu"
    target = load_target(cfg.target)
    out = export_target(target, args.out, args.dtype)
    print(f"wrote {out} ({args.dtype}); fingerprint {target.fingerprint['id']}")
    return 0


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog="headway", description=__doc__)
    parser.add_argument("--version", action="version", version=f"headway {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo",
        help="speculative decoding with the shipped EAGLE-3 head on the default target, measured "
        "beside plain decoding; --train runs the whole pipeline first (distil, train, export)",
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="self-distil, train and export a head first (~30 min on 2 CPU cores)",
    )
    _add_config_args(p, DemoConfig, cmd_demo, str(demo_config_file()))

    p = sub.add_parser(
        "distill", help="the frozen target answers prompts: a self-distilled training dataset"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start this many processes with torchrun (each answers a share)",
    )
    _add_config_args(p, RunConfig, cmd_distill)

    p = sub.add_parser(
        "cache-features",
        help="run the target once over train.datasets and keep the features heads read",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start this many processes with torchrun (each writes a share)",
    )
    _add_config_args(p, RunConfig, cmd_cache_features)

    p = sub.add_parser(
        "train", help="train a draft head on the frozen target from self-distilled data"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="start this many processes (torchrun, or deepspeed's launcher for train.backend=deepspeed)",
    )
    _add_config_args(p, RunConfig, cmd_train)

    p = sub.add_parser(
        "export",
        help="write a trained head for a serving engine (vLLM, SGLang, TensorRT-LLM, llama.cpp), checked key "
        "by key",
    )
    p.add_argument(
        "--head", help="a head directory, or a training run's directory (its head/ is exported)"
    )
    p.add_argument(
        "--format",
        choices=["native", "vllm", "sglang", "trtllm", "speculators", "gguf"],
        help="the engine layout (gguf: llama.cpp)",
    )
    p.add_argument(
        "--verifier",
        help="--format speculators: the target directory or hub id vLLM serves the draft with",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        help="--format speculators: the draft length vLLM runs (default: from the head)",
    )
    p.add_argument("--out", help="output directory (written whole or not at all)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32", "float16"],
        help="weights' dtype",
    )
    p.add_argument(
        "--check", metavar="DIR", help="only check an existing export against its engine layout"
    )
    _add_config_args(p, RunConfig, cmd_export)

    p = sub.add_parser(
        "generate", help="speculative decoding with a trained head; reports tau, tok/s and speedup"
    )
    p.add_argument("--head", required=True, help="a head directory (a run's head/ folder)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    _add_config_args(p, RunConfig, cmd_generate)

    p = sub.add_parser(
        "bench",
        help="speculative decoding beside plain decoding, HF generate and HF prompt lookup: "
        "tau, tok/s, speedups, exactness, per category",
    )
    p.add_argument("--head", required=True, help="a head directory")
    p.add_argument(
        "--prompts",
        help="jsonl/json/parquet prompt file (a `category` field groups results); default prompts.path",
    )
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument(
        "--per-category",
        type=int,
        help="only the first N prompts of each category (after --limit; bench.per_category)",
    )
    p.add_argument("--turns", type=int, help="user turns per prompt, 0 = all (bench.turns)")
    p.add_argument(
        "--out",
        default=None,
        help="results JSON (a Markdown table and a PNG plot beside it); default bench-DATE-TIME.json here. "
        "An existing result is never overwritten",
    )
    _add_config_args(p, RunConfig, cmd_bench)

    p = sub.add_parser(
        "tune",
        help="measure this machine and the head, pick the fastest tree, save it in the head directory",
    )
    p.add_argument("--head", required=True, help="a head directory")
    p.add_argument(
        "--prompts",
        help="calibration prompts (tune.prompts); default: the set shipped with Headway",
    )
    _add_config_args(p, RunConfig, cmd_tune)

    t = sub.add_parser("target", help="inspect or export the target model").add_subparsers(
        dest="target_command", required=True
    )
    p = t.add_parser("info", help="resolve the target and print its path and fingerprint")
    _add_config_args(p, RunConfig, cmd_target_info)
    p = t.add_parser(
        "export",
        help="write the target as a plain HF directory (safetensors) other engines can read",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    _add_config_args(p, RunConfig, cmd_target_export)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # deepspeed's launcher adds --local_rank=N unless told --no_local_rank; the rank comes from
    # the environment.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow options (`--head DIR key=value`), where argparse stops
    # collecting them.
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(getattr(args, "overrides", None) or []) + extra
    _setup_logging(args.verbose)
    try:
        cfg = load_config(args.schema, args.config, args.overrides)
        if args.print_config:
            print(config_to_yaml(cfg))
            return 0
        return args.run(cfg, args)
    except HeadwayError as e:
        print(f"headway: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("headway: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

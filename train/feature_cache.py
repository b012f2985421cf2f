"""The feature cache, written and read: run the frozen target once over the training data and keep
the hidden states a head reads, in safetensors shards, so training epochs (and sweeps) never run the
target again.

Layout of the output directory:
  shards/shard-NNNNN.safetensors  h{layer}: [tokens, hidden] for each cached layer, argmax: [tokens]
  (the
                                  target's greedy next token), offsets: [n + 1]
  manifest.json                   target fingerprint, layers, dtype, the sample keys of every shard
                                  and each shard's sha256 (written last: present = complete)
Each shard is written atomically and skipped when it exists, so a killed run resumes where it
stopped. Under a launcher (torchrun, deepspeed, `--nproc N`) rank r writes shards r, r + N, ...;
rank 0 checks that every shard is there and writes the manifest.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from headway.errors import HeadwayError
from headway.faults import fault_point
from headway.heads.draft_layer import text_config
from headway.io import atomic_file, atomic_write_json, sha256_file
from headway.kinds.registry import head_kind
from headway.ranks import dist_info
from headway.runtime import barrier, parse_dtype, resolve_device
from headway.target.loading import fingerprint_mismatch, load_target
from headway.train.config import FeaturesConfig
from headway.train.data import collate, load_samples

if TYPE_CHECKING:
    from headway.kinds.config import HeadConfig
    from headway.target.config import TargetConfig

log = logging.getLogger("headway")


@torch.no_grad()
def cache_features(
    model: Any,
    samples: list,
    keys: list[str],
    layers: list[int],
    fingerprint: dict,
    cfg: FeaturesConfig,
    identity: dict,
    pad_id: int,
) -> Path:
    """Write the shards and the manifest; `identity` (datasets, max_length) must match on resume."""
    info = dist_info()
    out = Path(cfg.output_dir).expanduser()
    (out / "shards").mkdir(parents=True, exist_ok=True)
    dtype = parse_dtype(cfg.dtype)
    run = {
        "target_fingerprint": fingerprint,
        "layers": layers,
        "dtype": cfg.dtype,
        "shard_size": cfg.shard_size,
        **identity,
    }
    run_file = out / "run.json"
    if run_file.is_file():
        previous = json.loads(run_file.read_text())
        if previous != run:
            changed = sorted(k for k in set(previous) | set(run) if previous.get(k) != run.get(k))
            raise HeadwayError(
                f"{out} holds features cached with other settings ({', '.join(changed)}): "
                "use another features.output_dir or delete it"
            )
    elif info.is_main:
        atomic_write_json(run_file, run)
    hidden = int(
        model.config.get_text_config().hidden_size
        if hasattr(model.config, "get_text_config")
        else model.config.hidden_size
    )
    tokens = sum(len(s.input_ids) for s in samples)
    need = tokens * len(layers) * hidden * dtype.itemsize
    log.info(
        "caching layers %s for %d sequences (%d tokens) in %s: needs %.2f GB of disk",
        layers,
        len(samples),
        tokens,
        cfg.dtype,
        need / 1e9,
    )
    if info.is_main:
        print(
            f"feature cache: {len(samples)} sequences, {tokens} tokens, layers {layers}, {cfg.dtype}: "
            f"{need / 1e9:.2f} GB on disk in {out}",
            flush=True,
        )
    device = next(model.parameters()).device
    starts = list(range(0, len(samples), cfg.shard_size))
    mine = [first for n, first in enumerate(starts) if n % info.world_size == info.rank]
    bar = tqdm(
        total=sum(len(samples[f : f + cfg.shard_size]) for f in mine),
        unit="seq",
        position=info.rank,
        desc=f"cache-features[rank {info.rank}]" if info.world_size > 1 else "cache-features",
    )
    for first in mine:
        path = out / "shards" / _shard_name(first, cfg.shard_size)
        part = samples[first : first + cfg.shard_size]
        if not path.is_file():
            _write_shard(model, part, layers, dtype, cfg.batch_size, pad_id, device, path, bar)
            fault_point(f"features:shard:{first // cfg.shard_size}")
        else:
            bar.update(len(part))
    bar.close()
    barrier(info)
    if info.is_main:
        shards = []
        for first in starts:
            path = out / "shards" / _shard_name(first, cfg.shard_size)
            if not path.is_file():
                raise HeadwayError(
                    f"feature shard {path} is missing after every rank finished: rerun the same command"
                )
            shards.append(
                {
                    "file": f"shards/{path.name}",
                    "keys": keys[first : first + cfg.shard_size],
                    "sha256": sha256_file(path),
                }
            )
        atomic_write_json(
            out / "manifest.json",
            {**run, "sequences": len(samples), "tokens": tokens, "shards": shards},
        )
    barrier(info)
    return out


def _shard_name(first: int, shard_size: int) -> str:
    return f"shard-{first // shard_size:05d}.safetensors"


def _write_shard(
    model: Any,
    part: list,
    layers: list[int],
    dtype: torch.dtype,
    batch_size: int,
    pad_id: int,
    device: Any,
    path: Path,
    bar: Any,
) -> None:
    """Run the target over one shard's sequences and write their features atomically."""
    per_layer: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    argmax: list[torch.Tensor] = []
    for b in range(0, len(part), batch_size):
        batch = collate(part[b : b + batch_size], pad_id)
        o = model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            output_hidden_states=True,
        )
        greedy = o.logits.argmax(-1).to(torch.int32).cpu()
        for row, s in enumerate(part[b : b + batch_size]):
            argmax.append(greedy[row, : len(s.input_ids)])
            for i in layers:
                per_layer[i].append(o.hidden_states[i][row, : len(s.input_ids)].to(dtype).cpu())
        bar.update(len(part[b : b + batch_size]))
    lengths = torch.tensor([0] + [len(s.input_ids) for s in part])
    tensors = {f"h{i}": torch.cat(per_layer[i]).contiguous() for i in layers}
    tensors["offsets"] = torch.cumsum(lengths, 0)
    tensors["argmax"] = torch.cat(argmax)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp))


class FeatureCache:
    """Reads cached features back by sample key, from one or several caches (one per group of
    datasets, so new data is cached without redoing the old). Refuses a cache made by another
    target, with other layers or max_length, caches that miss one of the training datasets, or a
    shard that no longer matches its checksum. Training on a subset of the cached datasets (a
    data-size sweep) reads just those samples."""

    def __init__(
        self, paths: str | Path | list, fingerprint: dict, layers: list[int], identity: dict
    ):
        self.paths = [
            Path(p).expanduser() for p in ([paths] if isinstance(paths, (str, Path)) else paths)
        ]
        self.where: dict[str, tuple[int, int]] = {}
        self.files: list[Path] = []
        cached: list[str] = []
        for path in self.paths:
            cached += self._read_manifest(path, fingerprint, layers, identity)
        extra = [d for d in identity["datasets"] if d not in cached]
        if extra:
            raise HeadwayError(
                f"features in {', '.join(map(str, self.paths))} were cached from {cached}, not from {extra}: "
                "cache them from every dataset you train on (training on a subset of the cached ones is fine)"
            )
        self.layers = layers
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}

    def _read_manifest(
        self, path: Path, fingerprint: dict, layers: list[int], identity: dict
    ) -> list[str]:
        """Check one cache against the run and index its shards; returns the datasets it holds."""
        manifest_file = path / "manifest.json"
        if not manifest_file.is_file():
            raise HeadwayError(
                f"{path} has no manifest.json: run `headway cache-features` to completion first"
            )
        m = json.loads(manifest_file.read_text())
        diff = fingerprint_mismatch(m["target_fingerprint"], fingerprint)
        if diff:
            raise HeadwayError(
                f"features in {path} were cached from another target ({'; '.join(diff)}): cache them again"
            )
        missing = [i for i in layers if i not in m["layers"]]
        if missing:
            raise HeadwayError(
                f"features in {path} hold layers {m['layers']}, not {missing} which this head reads: "
                "cache them with features.layers including those"
            )
        if m.get("max_length") != identity["max_length"]:
            raise HeadwayError(
                f"features in {path} were cached with max_length={m.get('max_length')}, but training "
                f"has train.max_length={identity['max_length']}: use the same, or cache them again"
            )
        for shard in m["shards"]:
            f = path / shard["file"]
            if not f.is_file() or sha256_file(f) != shard["sha256"]:
                raise HeadwayError(
                    f"feature shard {f} is missing or damaged (checksum differs): delete it and rerun "
                    "`headway cache-features` to rebuild it"
                )
            for row, key in enumerate(shard["keys"]):
                self.where[key] = (len(self.files), row)
            self.files.append(f)
        return list(m.get("datasets", []))

    def _handle(self, si: int) -> Any:
        if si not in self._open:
            if len(self._open) >= 8:
                self._open.pop(next(iter(self._open)))
            self._open[si] = safe_open(str(self.files[si]), framework="pt")
            self._offsets[si] = self._open[si].get_tensor("offsets")
        return self._open[si]

    def batch(
        self, keys: list[str], width: int, device: Any = "cpu"
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Right-padded features {layer: [B, width, h]} (float32 on `device`) and the target's
        greedy tokens [B, width]. The rows stay in the cache's dtype (bfloat16: half the bytes)
        until they are on the device, copied from pinned memory without a host wait on CUDA, and
        widen there."""
        out: dict[int, Optional[torch.Tensor]] = {i: None for i in self.layers}
        argmax = torch.zeros(len(keys), width, dtype=torch.long)
        for b, key in enumerate(keys):
            if key not in self.where:
                raise HeadwayError(
                    f"sample {key} is not in the feature caches "
                    f"{[str(p) for p in self.paths]}: cache the features again"
                )
            si, row = self.where[key]
            h = self._handle(si)
            lo, hi = (int(x) for x in self._offsets[si][row : row + 2])
            argmax[b, : min(width, hi - lo)] = h.get_slice("argmax")[lo:hi][:width].long()
            for i in self.layers:
                rows = h.get_slice(f"h{i}")[lo:hi]
                if out[i] is None:
                    out[i] = torch.zeros(len(keys), width, rows.shape[-1], dtype=rows.dtype)
                n = min(width, hi - lo)
                out[i][b, :n] = rows[:n]
        device = torch.device(device)
        pinned = device.type == "cuda" and torch.cuda.is_available()

        def up(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(device, non_blocking=True) if pinned else t.to(device)

        return {i: up(t).float() for i, t in out.items()}, up(argmax)


class CachedTarget:
    """A target whose forward is answered from the feature cache, for what reads a trained head's
    outputs over held-out sequences once training ends (Medusa's per-rank accuracy,
    train/calibration.py) when the run holds only part of the target (target/partial.py): its
    `model(input_ids=, attention_mask=, output_hidden_states=True)` returns the cached hidden
    states of those sequences (found by their tokens among `samples`), in the cache's layer order,
    the last one last."""

    def __init__(self, target: Any, cache: FeatureCache, samples: list):
        self.tokenizer = target.tokenizer
        self.config = target.config
        self.fingerprint = target.fingerprint
        self.device = target.device
        self.cache = cache
        self.keys = {tuple(s.input_ids): s.key for s in samples}

    def model(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any
    ) -> SimpleNamespace:
        lengths = attention_mask.sum(-1).tolist()
        rows = [row[:n].tolist() for row, n in zip(input_ids.cpu(), lengths)]
        missing = [i for i, row in enumerate(rows) if tuple(row) not in self.keys]
        if missing:
            raise HeadwayError(
                f"internal: {len(missing)} sequence(s) read back from the feature cache are not the "
                "held-out ones it was given"
            )
        keys = [self.keys[tuple(row)] for row in rows]
        hidden, _ = self.cache.batch(keys, input_ids.shape[1], self.device)
        return SimpleNamespace(hidden_states=tuple(hidden[i] for i in sorted(hidden)))


def layers_for(features: FeaturesConfig, head: HeadConfig, num_target_layers: int) -> list[int]:
    """features.layers, or those head.kind reads; always with the last layer (the target's
    logits)."""
    layers = list(features.layers)
    if not layers:
        layers = head_kind(head.kind).module.feature_layers(head.kind_config(), num_target_layers)
    bad = [i for i in layers if not 0 <= i <= num_target_layers]
    if bad:
        raise HeadwayError(
            f"features.layers {bad} outside the target's hidden states 0..{num_target_layers}"
        )
    return sorted(set(layers) | {num_target_layers})


def training_target_dtype(setting: str, target_dtype: str, device: torch.device) -> str:
    """The target's weights dtype in training and in `cache-features` alike (train.target_dtype):
    auto is bfloat16 on CUDA (the features engines serve) and target.dtype elsewhere, so a cache
    holds the features online training would compute on the same device."""
    if setting != "auto":
        return setting
    return "bfloat16" if device.type == "cuda" else target_dtype


def run_cache_features(
    target_cfg: TargetConfig,
    head: HeadConfig,
    features: FeaturesConfig,
    datasets: list[str],
    max_length: int,
    target_dtype: str = "auto",
) -> Path:
    """`headway cache-features`: the features of every sample of the datasets (held-out ones too).

    Args:
        target_cfg: the target whose hidden states are cached (the `target` section).
        head: the head section; its kind names the layers to cache when `features.layers` is empty.
        features: where and how to write the cache (the `features` section).
        datasets, max_length: `train.datasets` and `train.max_length`, which the training run must
            match.
        target_dtype: `train.target_dtype`, resolved as training resolves it
            (`training_target_dtype`).

    Returns:
        `features.output_dir`, holding a finished cache (manifest written last).
    """
    info = dist_info()
    if info.world_size > 1 and not torch.distributed.is_initialized():
        import datetime

        # barriers only
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
    dtype = training_target_dtype(target_dtype, target_cfg.dtype, resolve_device(target_cfg.device))
    target = load_target(replace(target_cfg, dtype=dtype))
    pairs, _ = load_samples(datasets, target.fingerprint, max_length)
    layers = layers_for(features, head, int(text_config(target.config).num_hidden_layers))
    identity = {"datasets": list(datasets), "max_length": max_length}
    out = cache_features(
        target.model,
        [s for _, s in pairs],
        [k for k, _ in pairs],
        layers,
        target.fingerprint,
        features,
        identity,
        target.tokenizer.pad_token_id or 0,
    )
    if info.world_size > 1:
        torch.distributed.destroy_process_group()
    return out

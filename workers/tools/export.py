"""`ddiloco export` and `ddiloco diff`: the global model at any point of a run (SPEC §7 'Evaluation').

The model *after commit SEQ* is, for every fragment, the version named by the newest ``init`` or
``merge`` commit at or before SEQ (found by scanning the log back from SEQ). Every version is
checked against its commit's ``output_checksum`` as it loads. ``export`` writes it as a plain
PyTorch state dict (``--format torch``, the default: float32 tensors under the model's own names;
``torch.load(weights_only=True)`` reads it) or as safetensors (``--format safetensors``, also chosen
by an output name ending in ``.safetensors``: the same tensors, plus the run id, the commit and
each fragment's version in the file's metadata, docs/formats.md "Exported weights"), or as a Hugging
Face directory (``--format hf``: ``model.safetensors`` and the ``config.json`` the run's learners
recorded, the ``save_pretrained`` layout ``from_pretrained`` reads). Every safetensors export also
carries the run's model config (issue 28: self-describing weights). ``diff``
prints per-tensor norms of the change between two points.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence, TextIO

import numpy as np

from pipeline.errors import FormatError
from pipeline.descriptor import RunDescriptor
from pipeline.types import CommitRecord
from storage.errors import NotFound, StoreError
from storage.layout import commit_key
from storage.log import CommitLog
from storage.shards import owned_fragments, shard_stores
from storage.store import ObjectStore
from workers.common.runs import open_run
from workers.tools.replay_cli import EXIT_DAMAGED, EXIT_USAGE, add_location_args, pipe_safe
from workers.common.versions import VersionTracker

FORMATS = ("torch", "safetensors", "hf")
HF_CONFIG = "hf_config"   # the descriptor's model map: a Hugging Face config.json (a learner's model_config)
# safetensors metadata (str -> str): "format" is the key other tools read ("pt": torch tensors);
# every other key is ours, under "ddiloco.", versioned by EXPORT_METADATA_VERSION (docs/formats.md).
# v1: commit_seq, and for a sharded run commit_seq -1 plus shard_seqs (added under v1: readers
# dropped it); v2: shard_seqs always (one seq per syncer shard; [commit_seq] unsharded); v3: model_config
# (the descriptor's model map as JSON: what rebuilds the model).
EXPORT_METADATA_VERSION = 3
EXPORT_METADATA_READS = (1, 2, 3)
META_PREFIX = "ddiloco."


def versions_at(store: ObjectStore, descriptor: RunDescriptor, seq: int) -> dict[int, CommitRecord]:
    """The newest version-carrying commit of every fragment at or before commit ``seq`` (of a
    shard's log: the fragments that shard owns, storage/shards.py)."""
    log = CommitLog(store)
    want = set(owned_fragments(store, descriptor))
    found: dict[int, CommitRecord] = {}
    s = seq
    while s >= 0 and not want <= found.keys():
        try:
            rec = log.read(s)
        except NotFound:
            raise NotFound(f"missing: commit {s} (looking for the versions in force at commit {seq})",
                           uri=store.uri, key=commit_key(s)) from None
        if rec.kind in ("init", "merge") and rec.fragment in want and rec.fragment not in found:
            found[rec.fragment] = rec
        s -= 1
    missing = sorted(want - set(found))
    if missing:
        raise FormatError(f"{store.uri}: no version of fragments {missing} at or before commit {seq}")
    return dict(sorted(found.items()))


def model_at(store: ObjectStore, descriptor: RunDescriptor, seq: int | Sequence[int],
             cache: dict[str, dict[str, np.ndarray]] | None = None
             ) -> tuple[dict[str, np.ndarray], dict[int, CommitRecord]]:
    """All tensors (float32, descriptor order) as they stood after commit ``seq``, and the commit
    of each fragment's version. ``cache`` (by version key) avoids decoding a version twice.

    A sharded run has one log per syncer shard and no single commit order: its point is
    one seq per shard (``resolve_seq``), and fragment p's version is the newest its owner (shard
    p % N) committed at or before that shard's seq (docs/formats.md "Export of a sharded run")."""
    seqs = [seq] if isinstance(seq, int) else list(seq)
    stores = shard_stores(store, descriptor)
    if len(seqs) != len(stores):
        raise ValueError(f"run {descriptor.run_id} has {len(stores)} commit logs: give one seq per shard, got {seqs}")
    commits = dict(sorted(kv for s, q in zip(stores, seqs) for kv in versions_at(s, descriptor, q).items()))
    parts: dict[str, np.ndarray] = {}
    trackers = [VersionTracker(s, descriptor) for s in stores]   # an int4 run's versions along their chain
    for p, rec in commits.items():
        if cache is not None and rec.output_key in cache:
            values = cache[rec.output_key]
        else:
            try:
                values = trackers[p % len(stores)].load(rec)
            except NotFound as e:   # e.key: the object missing (the version, a link or snapshot of its chain)
                raise NotFound(f"missing: version {rec.version} of fragment {p}, named by commit {rec.seq}",
                               uri=store.uri, key=e.key or rec.output_key) from None
            if cache is not None:
                cache[rec.output_key] = values
        parts.update(values)
    return {t.name: parts[t.name] for t in descriptor.layout.tensors}, commits


def resolve_point(store: ObjectStore, descriptor: RunDescriptor, text: str | int) -> int | tuple[int, ...]:
    """``resolve_seq`` for any run: in a sharded run, one seq per shard (``S0,S1,...`` in shard
    order; ``latest``: every shard's tail), each checked against its shard's log."""
    stores = shard_stores(store, descriptor)
    if len(stores) == 1:
        return resolve_seq(store, text)
    if isinstance(text, str) and text.lower() in ("latest", "tail"):
        return tuple(resolve_seq(s, "latest") for s in stores)
    parts = str(text).split(",")
    if len(parts) != len(stores):
        raise ValueError(f"run {descriptor.run_id} has {len(stores)} syncer shards, each with its own log: give "
                         f"one commit per shard, S0,...,S{len(stores) - 1} (or 'latest'), not {text!r}")
    return tuple(resolve_seq(s, q) for s, q in zip(stores, parts))


def resolve_seq(store: ObjectStore, text: str | int) -> int:
    """A commit number, or ``latest`` for the tail; ValueError if it is not in the log."""
    tail = CommitLog(store).tail()
    if isinstance(text, str) and text.lower() in ("latest", "tail"):
        return tail
    try:
        seq = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"commit {text!r} is not a number or 'latest'") from None
    if not 0 <= seq <= tail:
        raise ValueError(f"commit {seq} is not in the log (commits 0..{tail})")
    return seq


def state_dict(values: dict[str, np.ndarray]) -> dict:
    """A plain dict of float32 torch tensors (own memory, not views of read-only arrays)."""
    import torch
    return {n: torch.from_numpy(np.array(a, dtype=np.float32, copy=True)) for n, a in values.items()}


def export_metadata(descriptor: RunDescriptor, seq: int | Sequence[int],
                    commits: dict[int, CommitRecord]) -> dict[str, str]:
    """The safetensors metadata of the model after commit ``seq`` (``commits``: each fragment's
    version-carrying commit, as ``model_at`` returns them). A sharded run's point is one seq per
    shard: ``commit_seq`` is then -1 and ``shard_seqs`` lists them (fragment_commits are per shard)."""
    shard_seqs = [seq] if isinstance(seq, int) else list(seq)
    return {
        "format": "pt",
        f"{META_PREFIX}metadata_version": str(EXPORT_METADATA_VERSION),
        f"{META_PREFIX}run_id": descriptor.run_id,
        f"{META_PREFIX}commit_seq": str(seq if isinstance(seq, int) else -1),
        f"{META_PREFIX}shard_seqs": json.dumps(shard_seqs),
        f"{META_PREFIX}fragment_versions": json.dumps({str(p): r.version for p, r in commits.items()}),
        f"{META_PREFIX}fragment_commits": json.dumps({str(p): r.seq for p, r in commits.items()}),
        f"{META_PREFIX}dtype": "float32",
        f"{META_PREFIX}model_config": json.dumps(descriptor.model, sort_keys=True),
    }


@dataclass(frozen=True)
class ExportInfo:
    """What a safetensors export's metadata says about where its weights come from."""

    run_id: str
    commit_seq: int                       # -1 for a point of a sharded run (see shard_seqs)
    fragment_versions: dict[int, int]
    fragment_commits: dict[int, int]
    shard_seqs: tuple[int, ...] = ()      # one seq per syncer shard, shard order ((commit_seq,) unsharded)
    model_config: dict | None = None      # the run's model config (v3; None in older files)


def read_export_metadata(path: str | Path) -> ExportInfo:
    """The run, commit and fragment versions of a safetensors file ``ddiloco export`` wrote;
    FormatError if it has none or they are malformed, or a newer metadata version."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
    except Exception as exc:   # noqa: BLE001 - safetensors raises its own (untyped) errors on a bad header
        raise FormatError(f"{path}: not a readable safetensors file ({exc})") from None
    version = meta.get(f"{META_PREFIX}metadata_version")
    if version is None:
        raise FormatError(f"{path}: no ddiloco metadata (not written by `ddiloco export --format safetensors`)")
    try:
        if int(version) > EXPORT_METADATA_VERSION:
            raise FormatError(f"{path}: ddiloco metadata version {version} is newer than this reader "
                              f"({EXPORT_METADATA_VERSION}): upgrade decoupled-diloco")
        if int(version) not in EXPORT_METADATA_READS:
            raise FormatError(f"{path}: ddiloco metadata version {version} is not one of {list(EXPORT_METADATA_READS)}")
        commit_seq = int(meta[f"{META_PREFIX}commit_seq"])
        key = f"{META_PREFIX}shard_seqs"
        if int(version) >= 2 or key in meta:         # v2 always; v1 only in sharded runs
            shard_seqs = tuple(int(x) for x in json.loads(meta[key]))
        else:
            shard_seqs = (commit_seq,)
        return ExportInfo(
            run_id=meta[f"{META_PREFIX}run_id"], commit_seq=commit_seq,
            fragment_versions={int(p): int(v) for p, v in json.loads(meta[f"{META_PREFIX}fragment_versions"]).items()},
            fragment_commits={int(p): int(v) for p, v in json.loads(meta[f"{META_PREFIX}fragment_commits"]).items()},
            shard_seqs=shard_seqs,
            model_config=json.loads(meta[f"{META_PREFIX}model_config"]) if int(version) >= 3 else None)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise FormatError(f"{path}: malformed ddiloco metadata ({exc.__class__.__name__}: {exc})") from None


def write_export(path: Path, fmt: str, values: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write ``values`` (float32) as ``fmt`` through a temporary file, so a reader never sees half a
    file; ``metadata`` goes into a safetensors file (a torch state dict has no place for it)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: choose from {', '.join(FORMATS)}")
    if fmt == "hf":
        raise ValueError("write_export writes one file: a Hugging Face directory is write_hf_export")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if fmt == "torch":
        import torch
        torch.save(state_dict(values), tmp)
    else:
        from safetensors.numpy import save_file
        save_file({n: np.ascontiguousarray(a, dtype=np.float32) for n, a in values.items()}, str(tmp),
                  metadata=metadata)
    tmp.replace(path)


def write_hf_export(directory: Path, values: dict[str, np.ndarray], metadata: dict[str, str],
                    descriptor: RunDescriptor) -> None:
    """``directory/model.safetensors`` and ``directory/config.json`` (the run's ``hf_config``): the
    layout ``transformers``' ``from_pretrained(directory)`` reads. ValueError when the run has none."""
    config = descriptor.model.get(HF_CONFIG)
    if not isinstance(config, dict):
        raise ValueError(f"run {descriptor.run_id} records no Hugging Face config (its learners passed "
                         f"model_config={{'{HF_CONFIG}': model.config.to_dict()}}? see examples/hf_causal_lm.py); "
                         "export --format safetensors instead")
    directory.mkdir(parents=True, exist_ok=True)
    write_export(directory / "model.safetensors", "safetensors", values, metadata)
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(directory / "config.json")


@dataclass(frozen=True)
class TensorChange:
    """How one tensor changed from point A to point B."""

    tensor: str
    fragment: int
    version_a: int
    version_b: int
    norm_a: float
    norm_b: float
    norm_change: float        # ||B - A||_2
    relative: float           # ||B - A|| / ||A|| (inf if ||A|| = 0 and B != A)
    max_abs_change: float


def diff_models(a: dict[str, np.ndarray], b: dict[str, np.ndarray], descriptor: RunDescriptor,
                va: dict[int, CommitRecord], vb: dict[int, CommitRecord]) -> list[TensorChange]:
    frag = {n: p for p, names in enumerate(descriptor.layout.fragments) for n in names}
    out = []
    for t in descriptor.layout.tensors:
        x, y = a[t.name].astype(np.float64), b[t.name].astype(np.float64)
        d = y - x
        na, nd = float(np.linalg.norm(x)), float(np.linalg.norm(d))
        p = frag[t.name]
        out.append(TensorChange(t.name, p, va[p].version, vb[p].version, na, float(np.linalg.norm(y)), nd,
                                nd / na if na > 0 else (math.inf if nd > 0 else 0.0),
                                float(np.max(np.abs(d), initial=0.0))))
    return out


def _point(seq: int | Sequence[int]) -> str:
    return str(seq) if isinstance(seq, int) else "(" + ", ".join(f"shard {i}: {q}" for i, q in enumerate(seq)) + ")"


def _fail(err: TextIO, what: str, exc: Exception) -> int:
    print(f"{what} FAILED: {exc}", file=err)
    return EXIT_DAMAGED


def configure_export(parser: argparse.ArgumentParser):
    """Write the global model as it stood after a commit: a PyTorch state dict or safetensors."""
    add_location_args(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seq", default=None, metavar="SEQ", help="the commit after which to take the model (a "
                       "sharded run: one per syncer shard, S0,S1,... in shard order)")
    which.add_argument("--latest", action="store_true", help="the end of the log")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="file to write (e.g. model.pt, model.safetensors; a directory for --format hf)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="torch: a state dict for torch.load (the default); safetensors: the same tensors "
                             "with the run id, commit and fragment versions as metadata (the default for an "
                             "output name ending in .safetensors); hf: a directory with model.safetensors and the "
                             "run's config.json, for transformers' from_pretrained")
    return pipe_safe(export_command)


def export_command(args, out: TextIO, err: TextIO) -> int:
    try:
        store, descriptor = open_run(args.run_uri, s3_endpoint=args.s3_endpoint)
        seq = resolve_point(store, descriptor, "latest" if args.latest else args.seq)
    except (ValueError, StoreError, FormatError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    try:
        values, commits = model_at(store, descriptor, seq)
    except (StoreError, FormatError) as exc:
        return _fail(err, "export", exc)
    path = Path(args.output)
    fmt = args.format or ("safetensors" if path.suffix == ".safetensors" else "torch")
    try:
        if fmt == "hf":
            write_hf_export(path, values, export_metadata(descriptor, seq, commits), descriptor)
        else:
            write_export(path, fmt, values, export_metadata(descriptor, seq, commits))
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    except OSError as exc:
        print(f"error: cannot write {path}: {exc}", file=err)
        return EXIT_USAGE
    params = sum(a.size for a in values.values())
    versions = ", ".join(f"f{p} v{r.version}" for p, r in commits.items())
    print(f"wrote {path} ({fmt}): {len(values)} tensors, {params} parameters (float32), the model after "
          f"commit {_point(seq)} of run {descriptor.run_id} ({versions})", file=out)
    return 0


def configure_diff(parser: argparse.ArgumentParser):
    """Per-tensor norms of the change of the global model between two commits of a run."""
    add_location_args(parser)
    parser.add_argument("seq_a", metavar="SEQ_A", help="first point: a commit number or 'latest'")
    parser.add_argument("seq_b", metavar="SEQ_B", help="second point: a commit number or 'latest'")
    parser.add_argument("--json", action="store_true", help="JSON Lines, one object per tensor")
    return pipe_safe(diff_command)


def diff_command(args, out: TextIO, err: TextIO) -> int:
    try:
        store, descriptor = open_run(args.run_uri, s3_endpoint=args.s3_endpoint)
        sa, sb = resolve_point(store, descriptor, args.seq_a), resolve_point(store, descriptor, args.seq_b)
    except (ValueError, StoreError, FormatError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_USAGE
    try:
        cache: dict[str, dict[str, np.ndarray]] = {}
        a, va = model_at(store, descriptor, sa, cache)
        b, vb = model_at(store, descriptor, sb, cache)
    except (StoreError, FormatError) as exc:
        return _fail(err, "diff", exc)
    changes = diff_models(a, b, descriptor, va, vb)
    if args.json:
        for c in changes:
            print(json.dumps(asdict(c)), file=out)
        return 0
    total_a = math.sqrt(sum(c.norm_a ** 2 for c in changes))
    total_d = math.sqrt(sum(c.norm_change ** 2 for c in changes))
    width = max(len(c.tensor) for c in changes)
    print(f"run {descriptor.run_id}: change of the model from commit {_point(sa)} to commit {_point(sb)}", file=out)
    print(f"  {'tensor':<{width}} {'frag':>4} {'versions':>10} {'|A|':>10} {'|B-A|':>10} {'|B-A|/|A|':>10} "
          f"{'max|B-A|':>10}", file=out)
    for c in changes:
        print(f"  {c.tensor:<{width}} {c.fragment:>4} {f'v{c.version_a}->v{c.version_b}':>10} {c.norm_a:>10.4g} "
              f"{c.norm_change:>10.4g} {c.relative:>10.4g} {c.max_abs_change:>10.4g}", file=out)
    rel = total_d / total_a if total_a > 0 else math.inf
    print(f"  {'all':<{width}} {'':>4} {'':>10} {total_a:>10.4g} {total_d:>10.4g} {rel:>10.4g}", file=out)
    return 0

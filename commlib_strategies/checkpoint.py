"""Sharded, atomic, reshardable checkpoints of a training run (DP, ZeRO-1/2/3, TP, PP, CP,
MoE/EP, and the layouts commlib_strategies/layout.py composes from them).

On disk, inside a root directory::

    step-00000120/manifest.json        what every piece is, and each shard's sha256
    step-00000120/shard-00003.bin      raw tensor bytes written by rank 3

The content does not depend on the layout that wrote it. Each *piece* is a slice of a
*logical* tensor: a parameter of the reference GPT by its name and full, unpadded shape
("param"), or an optimizer state of the same shape ("exp_avg", "exp_avg_sq", ...). It is
``narrow(dim, start, length)`` of the tensor (a tensor-parallel slice, in the tensor padded
along ``dim``; ``dim`` None: the whole tensor), flattened, elements ``[lo, hi)`` (ZeRO's
shard cuts parameters anywhere). A loader in any layout rebuilds each logical tensor from
the pieces and keeps its own part; replicated data is written once, its replicas split it.
A pipeline stage, or an expert-parallel rank, holds some of the parameters: it writes and
reads those.

Saving is atomic: each rank writes and fsyncs its shard in ``.tmp-step-...``; then rank 0
writes the manifest (temporary name, fsync, rename, fsync) and renames the directory to
``step-...``. A crash at any point leaves no ``step-...`` directory half-written, and the
earlier checkpoints as they were. Loading reads JSON and raw bytes only (no unpickling)
and checks every shard's sha256 first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

from . import compression_state

MANIFEST = "manifest.json"
FORMAT = "commlib-strategies-checkpoint/1"
# dtypes by name: a manifest never makes us look up an arbitrary attribute of torch
DTYPES = {str(d)[len("torch."):]: d for d in (torch.float32, torch.float64, torch.float16,
                                              torch.bfloat16)}


def save_checkpoint(root, step: int, trainer) -> Path:
    """Save ``trainer`` (``.model``, ``.optimizer``, ``.zero`` or None, ``.mesh``) after
    ``step`` optimizer steps as ``root/step-<step>``; collective over the mesh's world.
    Returns the checkpoint's path. A checkpoint of the same step is replaced."""
    world = trainer.mesh.world
    if trainer.zero is not None:
        trainer.zero.settle()  # (gather_ahead: the parameters whole)
    root = Path(root)
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left behind by a save that crashed
        tmp.mkdir(mode=0o700)
    world.barrier()
    pieces, scalars = _pieces(trainer)
    name = f"shard-{world.rank:05d}.bin"
    index, digest, size = _write_shard(tmp / name, pieces)
    # the all-gather also tells rank 0 that every shard is written and fsynced
    shards = _all_gather_json(world, {"file": name, "sha256": digest, "bytes": size,
                                      "pieces": index, "scalars": scalars,
                                      "tensors": _logical_shapes(trainer),
                                      "compression": _save_compression(tmp, world.rank,
                                                                       trainer)})
    if world.rank == 0:
        manifest = {"format": FORMAT, "step": step, "byteorder": sys.byteorder,
                    "config": dataclasses.asdict(trainer.model.config),
                    "data": _data_settings(trainer),
                    "layout": {"world": world.size, **trainer.mesh.sizes,
                               "zero": trainer.zero.stage if trainer.zero else 0},
                    "optimizer": type(trainer.optimizer).__name__,
                    # every rank's: a stage or an expert-parallel rank holds some
                    "tensors": {k: v for s in shards for k, v in s["tensors"].items()},
                    "scalars": _merge([s["scalars"] for s in shards]),
                    "files": {s["file"]: {"sha256": s["sha256"], "bytes": s["bytes"]}
                              for s in shards},
                    "pieces": [dict(p, file=s["file"]) for s in shards for p in s["pieces"]]}
        if any(s["compression"] for s in shards):  # each rank's own, for this layout
            manifest["compression"] = {"signature": compression_state.signature(trainer),
                                       "ranks": [s["compression"] for s in shards]}
        _commit(root, tmp, final, manifest)
    world.barrier()
    return final


def latest_checkpoint(root) -> Path | None:
    """The complete checkpoint of ``root`` with the highest step, or None."""
    done = [d for d in Path(root).glob("step-*")
            if d.name[5:].isdigit() and (d / MANIFEST).is_file()]
    return max(done, key=lambda d: int(d.name[5:]), default=None)


@torch.no_grad()
def load_checkpoint(path, trainer) -> int:
    """Load a checkpoint (``path``: a ``step-...`` directory, or a root: its newest complete
    one) into ``trainer``, in whatever layout it has; returns the step it was saved at.
    Every rank reads what it needs itself: no communication, so every rank raises the same
    ValueError on a bad checkpoint, and then before changing anything."""
    path = _resolve(Path(path))
    if getattr(trainer, "zero", None) is not None:
        trainer.zero.settle()  # (no gather in flight overwrites what is loaded)
    try:
        manifest = _read_manifest(path, trainer)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path / MANIFEST} is malformed ({e!r})") from e
    blobs = {f: _read_verified(path / f, info) for f, info in manifest["files"].items()}
    held = _read_compression(path, manifest, trainer)
    by_tensor: dict = {}
    for piece in manifest["pieces"]:
        by_tensor.setdefault((piece["name"], piece["kind"]), []).append(piece)
    kinds = sorted({kind for _, kind in by_tensor} - {"param"})

    def scalars():  # fresh tensors for each parameter: the optimizer updates them in place
        return {k: v if dtype is None else torch.tensor(v, dtype=DTYPES[dtype])
                for k, (v, dtype) in manifest["scalars"].items()}
    def local(name, p, shape, kind):  # this rank's part of a logical tensor
        full = _assemble(path, name, kind, by_tensor.get((name, kind), []), blobs,
                         manifest["tensors"][name])
        split = _split(p, trainer.mesh)
        if split is not None:
            dim, _, parts, rank, count = split
            if parts > 1:  # a fused projection: this rank's slice of each part
                full = torch.cat([c.chunk(count, dim)[rank] for c in full.chunk(parts, dim)],
                                 dim)
            else:  # pad to a multiple of the ranks with zeros, as tensor_parallel does
                rows = -(-full.shape[dim] // count)
                padded = full.new_zeros(full.shape[:dim] + (rows * count,) + full.shape[dim + 1:])
                padded.narrow(dim, 0, full.shape[dim]).copy_(full)
                full = padded.narrow(dim, rank * rows, rows)
        if full.shape != shape:
            raise ValueError(f"{path}: {name} would be {tuple(full.shape)} here but the model "
                             f"holds {tuple(shape)}; this layout cannot load it")
        return full

    zero, optimizer = trainer.zero, trainer.optimizer
    if zero is None:
        values = {p: {k: local(name, p, shape, k) for k in ["param"] + kinds}
                  for name, p, shape in _local_params(trainer)}
        for p, state in values.items():  # everything read: now change the trainer
            p.copy_(state.pop("param"))
            state = {k: torch.empty_like(p).copy_(v) for k, v in state.items()}
            optimizer.state[p] = {**scalars(), **state} if state else {}
        compression_state.restore(compression_state.holders_of(trainer), held)
        return manifest["step"]
    # ZeRO: each unit's flat vector, built from the logical tensors; this rank keeps its shard
    names = {p: name for name, p in _named_parameters(trainer)}
    master = {k: torch.zeros_like(zero.master.data) for k in ["param"] + kinds}
    whole = []  # (parameter, value): stages 1 and 2 hold every parameter whole
    for u in zero.units:
        for kind, out in master.items():
            flat = torch.zeros(u.padded, dtype=out.dtype)
            for view, p, shape in zip(u.views(flat), u.params, u.shapes):
                view.copy_(local(names[p], p, shape, kind))
            out[u.master_offset:u.master_offset + u.shard_numel] = \
                flat.chunk(u.group.size)[u.group.rank]
            if kind == "param" and zero.stage < 3:
                whole += zip(u.params, u.views(flat))
    for p, value in whole:
        p.copy_(value)
    zero.master.data.copy_(master.pop("param"))
    if zero.stage == 3 and zero.param_shard.data_ptr() != zero.master.data_ptr():
        zero.param_shard.copy_(zero.master.data)  # bf16: what stage 3 gathers from
    optimizer.state[zero.master] = {**scalars(), **master} if master else {}
    compression_state.restore(compression_state.holders_of(trainer), held)
    return manifest["step"]


# ------------------------------------------------------------------------------ saving

def _local_params(trainer) -> list:
    """(name, parameter, shape on this rank): ZeRO-3 frees parameters, its units know."""
    shapes = {p: s for u in trainer.zero.units for p, s in zip(u.params, u.shapes)} \
        if trainer.zero else {}
    return [(n, p, shapes.get(p, p.shape)) for n, p in _named_parameters(trainer)]


def _named_parameters(trainer):
    """(the reference model's name, parameter) of what this rank holds."""
    named = getattr(trainer, "named_parameters", None)
    return named() if named is not None else trainer.model.named_parameters()


def _experts(trainer) -> set:
    from commlib_strategies.expert_parallel import expert_parameters  # (imports moe: heavy)
    return expert_parameters(trainer.model)


def _replicas(trainer, p, experts: set, over=("dp", "cp", "ep", "tp")) -> tuple:
    """(this rank's index among the ranks holding the same copy of ``p``, their count),
    along the dimensions ``over``: the dp and cp ranks, the tp ranks unless tp splits it,
    the ep ranks unless it is an expert; and a tied parameter's two pipeline copies."""
    mesh = trainer.mesh
    dims = [d for d in over if not (d == "ep" and id(p) in experts
                                    or d == "tp" and hasattr(p, "tp_split_dim"))]
    index, count = 0, 1
    for dim in dims:
        index, count = index * mesh.size(dim) + mesh.rank(dim), count * mesh.size(dim)
    if hasattr(p, "pp_replica"):  # a tied parameter's copy on the first or the last stage
        replica, replicas = p.pp_replica
        index, count = index * replicas + replica, count * replicas
    return index, count


def _split(p, mesh) -> tuple | None:
    """(dim, full size, fused parts, this rank's index, ranks) of a parameter that ranks
    hold slices of: tensor parallel's, or a transformers experts module's stacked experts
    split over ep (expert_parallel.py); None for one held whole."""
    if hasattr(p, "tp_split_dim"):
        return p.tp_split_dim, p.tp_full_size, getattr(p, "tp_parts", 1), mesh.rank("tp"), \
            mesh.size("tp")
    if hasattr(p, "ep_split_dim"):
        return p.ep_split_dim, p.ep_full_size, 1, mesh.rank("ep"), mesh.size("ep")
    return None


def _logical_shapes(trainer) -> dict:
    """name -> the full, unpadded shape (a list, as in the manifest)."""
    out = {}
    for name, p, shape in _local_params(trainer):
        out[name] = list(shape)
        split = _split(p, trainer.mesh)
        if split is not None:
            out[name][split[0]] = split[1]
    return out


def _part(lo: int, hi: int, index: int, count: int) -> tuple:
    """The ``index``-th of ``count`` contiguous near-equal parts of [lo, hi)."""
    n = max(hi - lo, 0)
    return lo + n * index // count, lo + n * (index + 1) // count


def _pieces(trainer) -> tuple:
    """([(description, 1-D data)] this rank writes, its optimizer's scalars such as step)."""
    mesh, zero, state = trainer.mesh, trainer.zero, trainer.optimizer.state
    out = []

    def add(name, p, shape, lo, hi, sources, at):
        """Elements [lo, hi) of the parameter's local flat tensor, which are ``sources``'
        (kind -> flat tensor) elements [at + lo, at + hi)."""
        dim, _, parts, rank, _ = _split(p, mesh) or (None, 0, 1, 0, 1)
        # a fused projection's slices of its parts lie rank after rank (_assemble reorders)
        region = {"dim": dim, "start": rank * shape[dim] if dim is not None else 0,
                  "length": shape[dim] if dim is not None else 0, "parts": parts}
        for kind, src in sources.items():
            if lo < hi:
                data = src[at + lo:at + hi].detach()
                out.append(({"name": name, "kind": kind, **region, "lo": lo, "hi": hi,
                             "dtype": str(data.dtype)[len("torch."):]}, data))

    if zero is None:
        experts = _experts(trainer)
        for name, p, shape in _local_params(trainer):
            index, count = _replicas(trainer, p, experts)
            sources = {"param": p.reshape(-1)}
            sources.update({k: v.reshape(-1) for k, v in state.get(p, {}).items()
                            if torch.is_tensor(v) and v.shape == p.shape})
            add(name, p, shape, *_part(0, p.numel(), index, count), sources, 0)
        return out, _merge([_scalars(state.get(p, {})) for _, p in _named_parameters(trainer)])
    master_state = state.get(zero.master, {})
    sources = {"param": zero.master}
    sources.update({k: v for k, v in master_state.items()
                    if torch.is_tensor(v) and v.shape == zero.master.shape})
    names = {p: name for name, p in _named_parameters(trainer)}  # the reference's names
    for u in zero.units:
        first = u.group.rank * u.shard_numel  # this rank holds the unit's flat [first, ...)
        offset = 0
        for p, shape in zip(u.params, u.shapes):
            lo, hi = max(offset, first), min(offset + shape.numel(), first + u.shard_numel)
            lo, hi = _part(lo, hi, *_replicas(trainer, p, set(), over=("cp", "tp")))
            add(names[p], p, shape, lo - offset, hi - offset, sources,
                u.master_offset + offset - first)
            offset += shape.numel()
    return out, _scalars(master_state)


def _scalars(state: dict) -> dict:
    """A parameter's scalar optimizer states (AdamW's step) as {key: [value, dtype]}."""
    return {k: [v.item(), str(v.dtype)[len("torch."):]] if torch.is_tensor(v) else [v, None]
            for k, v in state.items()
            if (torch.is_tensor(v) and v.dim() == 0) or isinstance(v, (int, float))}


def _merge(scalars: list) -> dict:
    """One value per key: every parameter takes every step, so they agree."""
    out = {}
    for d in scalars:
        for key, value in d.items():
            if out.setdefault(key, value) != value:
                raise ValueError(f"optimizer state {key!r} differs between parameters "
                                 f"({out[key][0]} and {value[0]}); it cannot be checkpointed")
    return out


def _write_shard(path: Path, pieces: list) -> tuple:
    digest, offset, index = hashlib.sha256(), 0, []
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        for description, data in pieces:
            blob = data.contiguous().view(torch.uint8).numpy().tobytes()
            f.write(blob)
            digest.update(blob)
            index.append({**description, "offset": offset})
            offset += len(blob)
        f.flush()
        _fsync(f.fileno())
    return index, digest.hexdigest(), offset


def _save_compression(tmp: Path, rank: int, trainer) -> dict | None:
    """This rank's compressed calls' state (compression_state.py) in a file of its own."""
    held = compression_state.named_arrays(compression_state.holders_of(trainer))
    if not held:
        return None
    name = f"compression-{rank:05d}.bin"
    index, digest, size = _write_shard(tmp / name, [
        ({"name": k, "shape": list(v.shape)}, torch.from_numpy(v.reshape(-1)))
        for k, v in held.items()])
    return {"file": name, "sha256": digest, "bytes": size, "pieces": index}


def _all_gather_json(world, obj) -> list:
    """Every rank's ``obj``, through JSON bytes (no pickling)."""
    mine = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = torch.empty(world.size, dtype=torch.int64)
    world.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:mine.numel()] = mine
    rows = torch.empty(world.size * padded.numel(), dtype=torch.uint8)
    world.all_gather(rows, padded)
    return [json.loads(bytes(row[:int(n)].tolist()))
            for row, n in zip(rows.view(world.size, -1), sizes)]


def _commit(root: Path, tmp: Path, final: Path, manifest: dict) -> None:
    _fsync_dir(tmp)  # the shards' directory entries are durable before the manifest names them
    part = tmp / (MANIFEST + ".tmp")
    with os.fdopen(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(manifest, f)
        f.flush()
        _fsync(f.fileno())
    os.replace(part, tmp / MANIFEST)
    _fsync_dir(tmp)
    old = root / f".old-{final.name}"
    if final.exists():  # a directory cannot be renamed over a non-empty one: move it aside
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(fd: int) -> None:
    os.fsync(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def _data_settings(trainer) -> dict:
    """What fixes the data stream besides the step (batches are a function of these)."""
    args = getattr(trainer, "args", None)
    return {k: getattr(args, k) for k in ("seed", "batch", "experts", "topk")
            if hasattr(args, k)} if args is not None else {}


# ------------------------------------------------------------------------------ loading

def _resolve(path: Path) -> Path:
    if not path.is_dir():
        raise ValueError(f"no checkpoint at {path}: not a directory; give a checkpoint root "
                         "(--save-dir) or one of its step-* directories")
    # a save is committed by the rename of .tmp-step-N: even with its manifest, it is not
    if path.name.startswith(".tmp-step-") or (path.name.startswith("step-")
                                               and not (path / MANIFEST).is_file()):
        raise ValueError(f"{path} is an incomplete checkpoint (its save did not finish); load "
                         "its root to get the newest complete one")
    if (path / MANIFEST).is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ValueError(f"no complete checkpoint in {path} (no step-*/{MANIFEST})")
    return found


def _read_manifest(path: Path, trainer) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / MANIFEST} is unreadable ({e}); load an earlier checkpoint")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path / MANIFEST} is not a {FORMAT} manifest")
    if manifest["byteorder"] != sys.byteorder:
        raise ValueError(f"{path} was written on a {manifest['byteorder']}-endian machine")
    mismatch = [f"{k}={v} (here {getattr(trainer.model.config, k, None)})"
                for k, v in manifest["config"].items()
                if getattr(trainer.model.config, k, None) != v]
    here = _data_settings(trainer)
    mismatch += [f"--{k} {v} (here {here.get(k)})"
                 for k, v in manifest["data"].items() if here.get(k) != v]
    if type(trainer.optimizer).__name__ != manifest["optimizer"]:
        mismatch.append(f"optimizer {manifest['optimizer']} "
                        f"(here {type(trainer.optimizer).__name__})")
    if mismatch:
        raise ValueError(f"{path} was saved with {', '.join(mismatch)}; resume with the "
                         "checkpoint's settings")
    tensors = _logical_shapes(trainer)
    held = tensors.keys()  # a pipeline stage or an expert-parallel rank: some of them
    if getattr(trainer, "pipeline", None) is None and not _experts(trainer):
        held = held | manifest["tensors"].keys()
    differ = sorted(n for n in held if tensors.get(n) != manifest["tensors"].get(n))
    if differ:
        raise ValueError(f"{path} holds other parameters than this model (names or shapes "
                         f"differ: {differ[:3]})")
    return manifest


def _read_compression(path: Path, manifest: dict, trainer) -> dict:
    """This rank's compressed calls' state, where the checkpoint was saved in this layout
    (in another one they start afresh: {})."""
    saved = manifest.get("compression")
    if not saved or saved["signature"] != compression_state.signature(trainer):
        return {}
    mine = saved["ranks"][trainer.mesh.world.rank]
    if mine is None:
        return {}
    blob = _read_verified(path / mine["file"], mine)
    return {p["name"]: compression_state.as_float32(
        blob[p["offset"]:p["offset"] + 4 * math.prod(p["shape"])], p["shape"])
        for p in mine["pieces"]}


def _read_verified(file: Path, info: dict) -> bytes:
    try:
        data = file.read_bytes()
    except OSError as e:
        raise ValueError(f"checkpoint shard {file} is unreadable ({e})") from e
    if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
        raise ValueError(f"checkpoint shard {file} fails its sha256 check: the file is "
                         "corrupt; load an earlier checkpoint")
    return data


def _assemble(path, name, kind, pieces, blobs, shape) -> torch.Tensor:
    """The logical tensor rebuilt from its pieces, each element covered exactly once."""
    if not pieces:
        raise ValueError(f"{path}: no data for {name} ({kind})")
    dim, padded = pieces[0]["dim"], list(shape)
    if any(p["dim"] != dim for p in pieces):
        raise ValueError(f"{path}: the pieces of {name} ({kind}) are split along different dims")
    try:
        if dim is not None:  # tensor-parallel pieces may include padding beyond the full size
            padded[dim] = max([shape[dim]] + [p["start"] + p["length"] for p in pieces])
        out = torch.zeros(padded, dtype=DTYPES[pieces[0]["dtype"]])
        count = torch.zeros(padded, dtype=torch.int32)
        for p in pieces:
            dtype = DTYPES[p["dtype"]]
            start, stop = p["offset"], p["offset"] + (p["hi"] - p["lo"]) * dtype.itemsize
            data = torch.frombuffer(bytearray(blobs[p["file"]][start:stop]), dtype=dtype)
            for target, values in ((out, data.to(out.dtype)), (count, 1)):
                region = target if dim is None else target.narrow(dim, p["start"], p["length"])
                flat = region.contiguous()  # a copy when the narrow is not contiguous
                flat.view(-1)[p["lo"]:p["hi"]] += values
                region.copy_(flat)
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: a piece of {name} ({kind}) does not fit the tensor: {e}")
    if dim is not None:
        out, count = out.narrow(dim, 0, shape[dim]), count.narrow(dim, 0, shape[dim])
    if not bool((count == 1).all()):
        raise ValueError(f"{path}: the pieces of {name} ({kind}) do not cover it exactly once")
    parts = pieces[0].get("parts", 1)
    if dim is not None and parts > 1:  # rank-major (r0's parts, r1's, ...) to part-major
        ranks = shape[dim] // pieces[0]["length"]
        split = out.shape[:dim] + (ranks, parts, -1) + out.shape[dim + 1:]
        out = out.reshape(split).transpose(dim, dim + 1).reshape(out.shape)
    return out

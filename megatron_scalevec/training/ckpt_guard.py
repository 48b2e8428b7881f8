"""What makes a checkpoint safe to load: a checksum manifest, the writer's versions, and loading
that cannot run code.

* ``scalevec_manifest.json`` in every ``iter_N`` folder: size and SHA-256 of every other file,
  and the megatron-core and torch versions that wrote it. Written after all files and before the
  checkpoint is published; checked on load (``--no-verify-checkpoint`` skips the hashing, the
  version check stays). The ranks hash disjoint subsets of the files.
* Nothing read from a checkpoint can execute code: loads run inside
  ``convert.safe_load.no_code_on_load`` (the one code-free loader, shared with the converters).
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import torch
import torch.distributed as dist

# the one code-free loader and its error (re-exported: the trainer catches CheckpointError)
from megatron_scalevec.convert.safe_load import (  # noqa: F401
    CheckpointError,
    install_metadata_guard,
    no_code_on_load,
)
from megatron_scalevec.training.corpus import sha256_file

MANIFEST = "scalevec_manifest.json"
MANIFEST_VERSION = 1


def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        from megatron.core import package_info  # noqa: PLC0415

        return package_info.__version__


def _version_tuple(text: str) -> tuple:
    out = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _files(ckpt_dir: str) -> list:
    out = []
    for root, _, names in os.walk(ckpt_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), ckpt_dir)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _split(items: list) -> list:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return items[rank::world]


def _gather(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_manifest(ckpt_dir: str, **extra) -> None:
    """Hash every file of ``ckpt_dir`` (collective: each rank a share) and write the manifest
    from rank 0 (fsync'd, atomic rename)."""
    files = _files(ckpt_dir)
    mine = {f: {"size": os.path.getsize(os.path.join(ckpt_dir, f)),
                "sha256": sha256_file(os.path.join(ckpt_dir, f))} for f in _split(files)}
    entries = {}
    for part in _gather(mine):
        entries.update(part)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    manifest = dict(manifest_version=MANIFEST_VERSION, megatron_core=megatron_core_version(),
                    torch=torch.__version__.split("+")[0], **extra,
                    files=dict(sorted(entries.items())))
    tmp = os.path.join(ckpt_dir, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, MANIFEST))


def read_manifest(ckpt_dir: str):
    """The manifest dict, or None for a checkpoint written without one."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        manifest["files"].items()
    except (ValueError, KeyError, AttributeError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint manifest ({e})") from None
    return manifest


def _check_file(ckpt_dir: str, rel: str, want: dict):
    path = os.path.join(ckpt_dir, rel)
    if not os.path.isfile(path):
        return f"{path}: missing (listed in {MANIFEST})"
    size = os.path.getsize(path)
    if size != want["size"]:
        return f"{path}: {size} bytes, {want['size']} when written (truncated or replaced)"
    if "sha256" in want and sha256_file(path) != want["sha256"]:
        return f"{path}: checksum mismatch (the bytes changed since the checkpoint was written)"
    return None


def verify_checkpoint(ckpt_dir: str, hashes: bool = True):
    """Check every file listed in the manifest: present, same size and (``hashes``) same
    SHA-256. Collective when a process group is up (same result on every rank). Returns the
    manifest, or None when the checkpoint has none. Raises CheckpointError naming the file."""
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return None
    items = sorted(manifest["files"].items())
    mine = [(rel, want if hashes else {"size": want["size"]}) for rel, want in _split(items)]
    errors = [e for e in (_check_file(ckpt_dir, rel, want) for rel, want in mine) if e]
    errors = sorted(e for part in _gather(errors) for e in part)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        hint = ("--no-verify-checkpoint skips this check" if "checksum mismatch" in errors[0]
                else "sizes are checked even with --no-verify-checkpoint: restore the file or "
                     "start from an earlier checkpoint")
        raise CheckpointError(f"checkpoint verification failed: {errors[0]}{more}; {hint}")
    return manifest


def check_readable_version(ckpt_dir: str, manifest) -> None:
    """A checkpoint of a newer megatron-core that keeps its common state inside the torch_dist
    files (0.19 and later: no ``common.pt``) cannot load in one that reads only ``common.pt``:
    say so, naming both versions, instead of failing as 'corrupt'."""
    from megatron.core.dist_checkpointing import serialization  # noqa: PLC0415

    if os.path.exists(os.path.join(ckpt_dir, "common.pt")):
        return
    if not os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        return
    if hasattr(serialization, "_legacy_common_state_exists"):  # reads both layouts
        return
    installed = megatron_core_version()
    writer = (manifest or {}).get("megatron_core")
    by = f"megatron-core {writer}" if writer else "a newer megatron-core (0.19 or later)"
    raise CheckpointError(
        f"{ckpt_dir} was written by {by}, which stores the common state inside the torch_dist "
        f"files (no common.pt); the installed megatron-core {installed} cannot read that "
        f"format: load it with megatron-core >= {writer or '0.19'}")


def version_note(manifest) -> str:
    """' (written by megatron-core A, installed B)' when they differ, else ''."""
    writer = (manifest or {}).get("megatron_core")
    installed = megatron_core_version()
    if writer and _version_tuple(writer) != _version_tuple(installed):
        return f" (written by megatron-core {writer}, installed {installed})"
    return ""

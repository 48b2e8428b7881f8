"""Training logs: console line, ``metrics.jsonl`` in the run dir, TensorBoard when installed,
and scale-vector statistics (vector norms, each parameterization's own statistics such as OR's
magnitude beta: ``Parameterization.statistics``, the conservation quantity).

Conservation (SPEC.md): with gamma = 1 and small W at init, ``gamma_j^2 - ||w_j||^2`` stays
constant along gradient flow, ``w_j`` being column j of the matrix the vector feeds. We log its
mean over columns j for every input-side vector that feeds a known matrix: the per-branch HG
vectors (``scale_in.q`` -> the q rows of ``linear_qkv``) and shared Pre-Norm vectors (->
the whole ``linear_qkv`` / ``linear_fc1``).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megatron_scalevec import sharding
from megatron_scalevec.declared import declared, pre_norm_readers, sites
from megatron_scalevec.vectors import ScaleVector


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _col_sq_norm(linear, branch=None) -> torch.Tensor:
    """||w_j||^2 per input column j of a column-parallel linear (all its rows, or one branch's
    rows of a fused one), summed over the tensor-parallel ranks."""
    w = linear.weight.detach().float()
    if branch is not None:
        w = w.view(linear.groups, len(linear.slots), linear.rows, w.shape[1])
        idx = [i for i, s in enumerate(linear.slots) if s == branch]
        w = w[:, idx]
    sq = w.pow(2).reshape(-1, w.shape[-1]).sum(0)
    group = getattr(linear, "tp_group", None) or sharding.tp_group(False)
    return sharding.all_reduce_sum(sq, group) if sharding.group_size(group) > 1 else sq


def _key(name: str, chunk_idx: int, chunks: int) -> str:
    return f"sv/{name}" if chunks == 1 else f"sv/chunk{chunk_idx}/{name}"


def vector_sites(model) -> dict:
    """{"sv/<path>": [site, side, branch]} for this rank's vectors (declared.sites), written
    once beside metrics.jsonl so plots group vectors by what they scale, not by name."""
    return {_key(name, i, len(model)): list(where) for i, chunk in enumerate(model)
            for name, where in sites(_unwrap(chunk)).items()}


@torch.no_grad()
def scale_vector_stats(model) -> dict:
    """{"sv/<path>/norm", "sv/<path>/<statistic>" (its parameterization's: OR's "beta"),
    "sv/<path>/conservation"} for this rank's vectors
    (pipeline stage and expert shard; split vectors are reduced over their group). Each vector
    is read through its module call (megatron-core's DDP hooks: an overlapped parameter gather
    is waited for); every value stays on the device until one host read for all of them."""
    stats = {}
    for chunk_idx, chunk in enumerate(model):
        root = _unwrap(chunk)
        feeds = {}  # id(vector) -> (the linear whose columns it scales, branch)
        for d in declared(root):
            if d.side == "in" and d.target is not None and hasattr(d.target, "slots"):
                feeds[id(d.vector)] = (d.target, d.branch)
        for layer in root.modules():
            for norm, readers in pre_norm_readers(layer):
                if len(readers) == 1:  # a shared Pre-Norm gamma feeding one whole matrix
                    feeds.setdefault(id(norm), (readers[0], None))
        for d in declared(root, owned=True):
            vec, name = d.vector, d.name
            if not isinstance(vec, ScaleVector) or not vec.enabled:
                continue
            key = _key(name, chunk_idx, len(model))
            gamma = vec().detach().float()  # its call: DDP's pre-hooks run first
            sq = sharding.all_reduce_sum(gamma.pow(2).sum(), vec.split_group)
            stats[f"{key}/norm"] = sq.sqrt()
            for stat, value in vec.scheme.statistics(vec).items():
                stats[f"{key}/{stat}"] = value
            if id(vec) in feeds and vec.split_group is None:
                linear, branch = feeds[id(vec)]
                try:
                    wsq = _col_sq_norm(linear, branch)
                except (RuntimeError, AttributeError):
                    continue
                if wsq.shape == gamma.shape:
                    stats[f"{key}/conservation"] = (gamma.pow(2) - wsq).mean()
    if not stats:
        return {}
    values = torch.stack([t.reshape(()) for t in stats.values()]).tolist()  # one host read
    return dict(zip(stats, values))


class MetricsLog:
    """Writes one JSON object per record to ``run_dir/metrics.jsonl`` (rank 0 only) and, when
    ``tensorboard`` is importable and a dir is given, the same scalars to TensorBoard."""

    def __init__(self, run_dir: str, tensorboard_dir=None, quiet=False, append=False):
        self.enabled = dist.get_rank() == 0
        self.quiet = quiet
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb = None
        self.created = []  # what this run made, removed by discard()
        if not self.enabled:
            return
        if not os.path.isdir(run_dir):
            os.makedirs(run_dir)
            self.created.append(run_dir)
        if not os.path.exists(self.path):
            self.created.append(self.path)
        self.file = open(self.path, "a" if append else "w")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

                self.tb = SummaryWriter(log_dir=tensorboard_dir)
            except ImportError:
                self.print("tensorboard is not installed (pip install "
                           "'megatron_scalevec[tensorboard]'): --tensorboard-dir ignored "
                           "(metrics.jsonl has the same scalars)")

    def write_config(self, args) -> None:
        """``config.json`` beside metrics.jsonl: the flags of this run (plots title with it)."""
        self.write_json("config.json", {k: v for k, v in sorted(vars(args).items())
                                        if isinstance(v, (str, int, float, bool, type(None),
                                                          list))})

    def write_json(self, name: str, obj) -> None:
        """``name`` beside metrics.jsonl (rank 0), replaced whole."""
        if not self.enabled:
            return
        path = os.path.join(os.path.dirname(self.path), name)
        if not os.path.exists(path):
            self.created.append(path)
        tmp = os.path.join(os.path.dirname(self.path), f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)

    def print(self, text: str) -> None:
        if self.enabled and not self.quiet:
            print(text, flush=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        from megatron_scalevec.training.faults import finite_or_none  # noqa: PLC0415

        record = finite_or_none(record)
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record.get("iteration", 0)
            for k, v in record.items():
                if k != "iteration" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def drop_after(self, iteration: int) -> int:
        """On resume: rows past the checkpoint's ``iteration`` (the stopped run's, trained again
        now) and a torn last line leave ``metrics.jsonl``, so its iterations run once, in
        order. Rewritten atomically; returns the number of rows dropped."""
        if not self.enabled:
            return 0
        self.file.close()
        with open(self.path) as f:
            lines = f.readlines()
        keep = [line for line in lines if _row_iteration(line) <= iteration]
        if len(keep) != len(lines):
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(keep)
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        return len(lines) - len(keep)

    def discard(self) -> None:
        """Close and remove what this log created (a run refused before its first step leaves
        no files behind); files of a resumed run are kept."""
        self.close()
        for path in reversed(self.created):
            if os.path.isdir(path):
                if not os.listdir(path):
                    os.rmdir(path)
            elif os.path.exists(path):
                os.remove(path)
        self.created = []

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def _row_iteration(line: str) -> float:
    """A metrics row's iteration (0 for rows without one, infinity for a torn line)."""
    try:
        return json.loads(line).get("iteration", 0)
    except (ValueError, AttributeError):
        return float("inf")

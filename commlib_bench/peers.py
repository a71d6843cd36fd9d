"""Implementations measured side by side ("peers"), and the buffers they share.

A peer runs any collective of commlib_bench.specs on a Case; ``unsupported`` says why it cannot
(shown as n/a). Adding an implementation is a class with one method per collective.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import commlib

from .internals import algorithm_entry, mapped
from .specs import count_wrong, itemsize


def alloc(count: int, dtype: str, device: str = "cpu", pages: str = "numpy", comm=None):
    """``count`` zeros: a numpy array (where numpy puts it: its large arrays on huge pages,
    where the kernel gives them; or ``pages`` "huge" or "base", 4 KiB ones, or "region":
    ``comm.empty``'s memory, which every rank of the host maps), else (bfloat16, GPUs) a
    torch tensor."""
    if dtype == "bfloat16" or device != "cpu":  # numpy has no bfloat16, no GPU: torch tensors
        import torch
        return torch.zeros(count, dtype=getattr(torch, dtype), device=device)
    if pages == "numpy":
        return np.zeros(count, dtype)
    array = comm.empty(count, dtype) if pages == "region" else \
        mapped(count, dtype, huge=pages == "huge")
    array[:] = 0
    return array


def to_f64(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return buf.astype(np.float64)
    import torch
    return buf.to(torch.float64).cpu().numpy()


def assign(buf, values: np.ndarray) -> None:
    if isinstance(buf, np.ndarray):
        buf[...] = values.astype(buf.dtype)
    else:
        import torch
        buf.copy_(torch.from_numpy(values))


class Case:
    """This rank's buffers for one collective at one size (in-place forms share memory)."""

    def __init__(self, spec, n, rank, count, dtype, op=None, root=0, inplace=False,
                 device="cpu", pages="numpy", comm=None):
        (self.spec, self.n, self.rank, self.dtype, self.op,
         self.root) = spec, n, rank, dtype, op, root
        parts = spec.kind.parts
        self.inplace = inplace and parts in ("scatter", "gather")
        self.count, self.device = count, device
        n_in, n_out = spec.buffer_counts(n, count)
        if spec.kind.in_place:
            self.inp = self.out = alloc(n_in, dtype, device, pages, comm)
        elif self.inplace and parts == "scatter":
            self.inp = alloc(n_in, dtype, device, pages, comm)
            self.out = self.inp[rank * n_out:(rank + 1) * n_out]
        elif self.inplace:
            self.out = alloc(n_out, dtype, device, pages, comm)
            self.inp = self.out[rank * n_in:(rank + 1) * n_in]
        else:
            self.inp = alloc(n_in, dtype, device, pages, comm)
            self.out = alloc(n_out, dtype, device, pages, comm)
        self._torch = None

    @property
    def nbytes(self) -> int:
        return self.count * itemsize(self.dtype)

    def torch_views(self):
        """(input, output) as torch tensors sharing this case's memory."""
        if self._torch is None:
            import torch
            as_t = lambda b: b if isinstance(b, torch.Tensor) else torch.from_numpy(b)  # noqa
            self._torch = as_t(self.inp), as_t(self.out)
        return self._torch

    def fill_for_check(self) -> np.ndarray:
        """Exact input data; returns the output this rank must end with."""
        mine, want = self.spec.expected(self.n, self.rank, self.count, self.op, self.root,
                                        self.dtype == "uint8")
        if self.inp is not self.out:
            assign(self.out, np.zeros(len(self.out)))
        assign(self.inp, mine)
        return want

    def wrong(self, want: np.ndarray) -> int:
        return count_wrong(to_f64(self.out), want, self.dtype, self.op)


class CommlibPeer:
    def __init__(self, comm: commlib.Communicator, algorithm: str):
        self.comm, self.algorithm = comm, algorithm
        self.name = f"commlib:{algorithm}"

    def unsupported(self, case):
        name = case.spec.name
        if self.algorithm == "auto":
            return None
        if self.algorithm not in self.comm.algorithms(name):
            return f"no {self.algorithm} {name}"
        # (the primary buffer's bytes, as commlib chooses by: the smaller of in and out)
        primary = min(len(case.inp), len(case.out)) * itemsize(case.dtype)
        refuses = algorithm_entry(name, self.algorithm).refuses
        return refuses and refuses(case.n, primary)

    CALLS = {  # each collective's call on a Case c, by algorithm a (None: auto)
        "all_reduce": lambda comm, c, a: comm.all_reduce(c.out, c.op, a),
        "reduce_scatter": lambda comm, c, a: comm.reduce_scatter(c.out, c.inp, c.op, a),
        "all_gather": lambda comm, c, a: comm.all_gather(c.out, c.inp, a),
        "all_to_all": lambda comm, c, a: comm.all_to_all(c.out, c.inp, algorithm=a),
        "broadcast": lambda comm, c, a: comm.broadcast(c.out, c.root, a),
        "reduce": lambda comm, c, a: comm.reduce(c.out, c.root, c.op, a)}

    def run(self, c):
        self.CALLS[c.spec.name](self.comm, c, None if self.algorithm == "auto" else self.algorithm)


class DeterministicPeer(CommlibPeer):
    """auto on a communicator in deterministic mode (Communicator.dup): what reducing in
    rank order costs, beside auto."""

    def __init__(self, comm: commlib.Communicator):
        super().__init__(comm.dup(deterministic=True), "auto")
        self.name = "commlib:deterministic"

    def unsupported(self, case):
        return None if case.spec.reduces else "the same as auto: nothing reduces"


class RegisteredPeer(CommlibPeer):
    """commlib's collectives on GPU inputs registered with the communicator (zero-copy
    IPC); each case's input is registered once, before its first timed call."""

    def __init__(self, comm: commlib.Communicator):
        super().__init__(comm, "auto")
        self.name = "commlib:registered"
        self.registered = None  # (the case's input, its RegisteredMemory)

    def unsupported(self, case):
        if case.device != "cuda" or self.comm.size == 1:
            return "registered memory: GPU memory at 2+ ranks"
        return None

    def run(self, c):
        if self.registered is None or self.registered[0] is not c.inp:
            if self.registered is not None:
                self.registered[1].close()
            self.registered = (c.inp, self.comm.register(c.inp))
        super().run(c)


class MPIPeer:
    """The MPI library's own collectives, called directly through mpi4py."""
    name = "mpi"
    OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def __init__(self, mpi_comm: MPI.Comm):
        self.comm = mpi_comm

    def unsupported(self, c):
        if c.device != "cpu":
            return "MPI through mpi4py takes host memory"
        if c.spec.reduces and (c.op not in self.OPS or c.dtype in ("float16", "bfloat16")):
            return f"MPI has no {c.op} on {c.dtype}"
        if c.dtype == "bfloat16":
            return "numpy has no bfloat16"
        if c.inplace and c.spec.kind.parts == "scatter":
            return "MPI's in-place reduce_scatter keeps block 0, not block rank"
        return None

    CALLS = {  # each collective's call on a Case c, by MPI op op
        "all_reduce": lambda comm, c, op: comm.Allreduce(MPI.IN_PLACE, c.out, op),
        "reduce_scatter": lambda comm, c, op: comm.Reduce_scatter_block(c.inp, c.out, op),
        "all_gather": lambda comm, c, op: comm.Allgather(MPI.IN_PLACE if c.inplace else c.inp,
                                                         c.out),
        "all_to_all": lambda comm, c, op: comm.Alltoall(c.inp, c.out),
        "broadcast": lambda comm, c, op: comm.Bcast(c.out, c.root),
        "reduce": lambda comm, c, op: comm.Reduce(MPI.IN_PLACE if comm.rank == c.root else c.out,
                                                  c.out if comm.rank == c.root else None, op,
                                                  c.root)}

    def run(self, c):
        self.CALLS[c.spec.name](self.comm, c, self.OPS.get(c.op))


class GlooPeer:
    """torch.distributed's gloo backend on the same buffers (as torch tensors)."""
    name = "gloo"
    root_only = True  # its reduce leaves partial sums elsewhere (torch: only dst receives)

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                    "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def unsupported(self, c):
        if c.spec.reduces and c.op not in self.OPS:
            return f"gloo has no {c.op}"
        if c.inplace:
            return "in-place form not measured for gloo"
        if c.device != "cpu" and c.spec.name not in self.ON_CUDA:
            return "gloo takes CUDA tensors for all_reduce and broadcast only"
        return None

    ON_CUDA = ("all_reduce", "broadcast")  # the collectives gloo runs on CUDA tensors
    # each collective's call on torch.distributed d, group g (the world: its ranks are the
    # global ranks), a Case c's tensors (inp, out), by op
    CALLS = {
        "all_reduce": lambda d, g, c, inp, out, op: d.all_reduce(out, op, group=g),
        "reduce_scatter": lambda d, g, c, inp, out, op: d.reduce_scatter_tensor(out, inp, op,
                                                                                group=g),
        "all_gather": lambda d, g, c, inp, out, op: d.all_gather_into_tensor(out, inp, group=g),
        "all_to_all": lambda d, g, c, inp, out, op: d.all_to_all_single(out, inp, group=g),
        "broadcast": lambda d, g, c, inp, out, op: d.broadcast(out, c.root, group=g),
        "reduce": lambda d, g, c, inp, out, op: d.reduce(out, c.root, op, group=g)}

    def run(self, c):
        self.CALLS[c.spec.name](self.dist, self.group, c, *c.torch_views(), self.OPS.get(c.op))


def gloo_group():
    """A gloo process group over MPI's world, or None when torch is not installed."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_initialized():
        from commlib.torch.backend import init_process_group
        init_process_group("gloo")
    return dist.group.WORLD


def make_peers(comm, names: list[str]) -> list:
    """Peers by name: commlib:<algorithm>|commlib:auto|commlib:deterministic|
    commlib:registered|mpi|gloo (gloo needs torch)."""
    peers = []
    for name in names:
        if name == "commlib:registered":
            peers.append(RegisteredPeer(comm))
        elif name == "commlib:deterministic":
            peers.append(DeterministicPeer(comm))
        elif name.startswith("commlib:"):
            peers.append(CommlibPeer(comm, name.split(":", 1)[1]))
        elif name == "mpi":
            peers.append(MPIPeer(comm.mpi))
        elif name == "gloo":
            group = gloo_group()
            if group is not None:
                peers.append(GlooPeer(group))
        else:
            raise ValueError(f"unknown implementation {name!r}: use commlib:<algorithm>, "
                             "commlib:auto, commlib:deterministic, mpi or gloo")
    return peers

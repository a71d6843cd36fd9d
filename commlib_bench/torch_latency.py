"""All-reduce time per call through PyTorch: our API and backend, gloo, DeepSpeed's shm op

    mpiexec -n 2 commlib-bench torch-latency
    torchrun --nproc-per-node 2 -m commlib_bench torch-latency

The same torch tensor goes to every *peer*: ``api:numpy`` (commlib's API on a numpy view of
it; float32 only), ``api:torch`` (commlib's API on the tensor), ``dist:commlib``
(``dist.all_reduce`` on commlib, the default group), ``dist:gloo``, and ``deepspeed`` (DeepSpeed's
shared-memory all-reduce, ``torch.ops.deepspeed.inference_all_reduce_``, where deepspeed
is installed, all ranks share a host and the CPU has the instructions its kernel needs for
the dtype). A round times ``reps`` back-to-back calls of each peer after a barrier, peers
in a rotating order; a call's time is the slowest rank's; the table shows medians over
rounds, in microseconds, and two ratios: dist:commlib over api:torch, and over deepspeed.
"""
from __future__ import annotations

import glob
import os
import socket
import time
import zlib

import numpy as np

from .harness import parse_size, print_table, sizes, write_json

TARGET_SECONDS = 0.02  # what one peer's timed calls take per round, about


def add_arguments(p):
    p.add_argument("--min", default="1K", help="smallest message (default 1K)")
    p.add_argument("--max", default="64M", help="largest message (default 64M)")
    p.add_argument("--factor", type=int, default=4, help="size step (default 4)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--peers", default="api:numpy,api:torch,dist:commlib,dist:gloo,deepspeed",
                   help="comma-separated, of those in the command's help")
    p.add_argument("--json", default=None, help="write results to this file")


def main(args, comm) -> int:
    import torch
    import torch.distributed as dist

    import commlib.torch.backend as tb
    torch.set_num_threads(1)
    if not dist.is_initialized():  # (as users run it: commlib's the default group, which
        tb.init_process_group()      # torch's frontend reaches faster than a subgroup)
    group = (dist.group.WORLD if dist.get_backend() == tb.BACKEND
             else dist.new_group(backend=tb.BACKEND))
    comm = group.comm  # (its communicator: what the API peers and the timing use)
    peers = _peers(args.peers.split(","), comm, group, dist, torch)
    dtypes = args.dtypes.split(",")
    rows = []
    for nbytes in sizes(parse_size(args.min), parse_size(args.max), args.factor):
        for dtype in dtypes:
            t = torch.zeros(nbytes // torch.empty(0, dtype=getattr(torch, dtype)).itemsize,
                            dtype=getattr(torch, dtype))
            times = {p.name: _median_call(comm, p, t, args.rounds) for p in peers}
            rows.append({"bytes": nbytes, "dtype": dtype, **{k: v * 1e6 for k, v in
                                                             times.items()}})
    if comm.rank == 0:
        _print(rows, [p.name for p in peers], comm.size)
        if args.json:
            write_json(args.json, "torch-latency", comm, rows,
                       launcher="torchrun" if os.environ.get("TORCHELASTIC_RUN_ID")
                       else "mpiexec", units="us per call")
    for p in peers:
        p.close()
    return 0


def _median_call(comm, peer, t, rounds: int) -> float:
    """Seconds per call of ``peer`` on ``t`` (the slowest rank's, median over rounds), NaN
    where it cannot run; checks the result first."""
    why = peer.unsupported(t)
    if _any_rank(comm, why is not None):
        return float("nan")
    _check(comm, peer, t)
    t.zero_()  # (sums of zeros: no overflow in the timed calls)
    reps = _reps(comm, peer, t)
    per_call = np.empty(rounds)
    for r in range(rounds):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            peer.run(t)
        per_call[r] = (time.perf_counter() - start) / reps
    comm.all_reduce(per_call, "max")
    return float(np.median(per_call))


def _reps(comm, peer, t) -> int:
    """Calls per round: about TARGET_SECONDS' worth (the slowest rank's estimate)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(3):
        peer.run(t)
    estimate = np.array([(time.perf_counter() - start) / 3])
    comm.all_reduce(estimate, "max")
    return int(min(2000, max(3, TARGET_SECONDS / max(estimate[0], 1e-7))))


def _check(comm, peer, t) -> None:
    """One call on rank-valued data must leave the sum over ranks (exact in every dtype
    at these sizes) in every element."""
    t.fill_(comm.rank + 1)
    peer.run(t)
    want = comm.size * (comm.size + 1) // 2
    wrong = int((t != want).sum())
    if _any_rank(comm, wrong):
        raise SystemExit(f"torch-latency: {peer.name} left wrong sums ({wrong} of {t.numel()} "
                         f"{t.dtype} elements on rank {comm.rank}, or on another rank)")


def _any_rank(comm, flag) -> bool:
    flags = np.array([1 if flag else 0], np.int64)
    comm.all_reduce(flags, "max")
    return bool(flags[0])


def _print(rows, names, n):
    print(f"# all_reduce through PyTorch, {n} ranks: us per call (median), slowest rank")
    header = ["bytes", "dtype", *names, "dist/api", "dist/deepspeed"]
    table = []
    for row in rows:
        api, dist_, ds = (row.get(k, float("nan")) for k in ("api:torch", "dist:commlib",
                                                            "deepspeed"))
        table.append([row["bytes"], row["dtype"], *(row[k] for k in names),
                      dist_ / api, dist_ / ds])
    print_table(header, table)


# --------------------------------------------------------------------------- peers
# Each: ``name``, ``unsupported(t)`` (None, or why it cannot run on ``t``), ``run(t)`` (an
# in-place sum of ``t`` over the ranks), ``close()``.

class ApiPeer:
    """commlib's own API, on the tensor or (``numpy``) on a numpy view of its memory."""

    def __init__(self, comm, numpy: bool):
        self.comm, self.numpy = comm, numpy
        self.name = "api:numpy" if numpy else "api:torch"
        self._views: dict = {}

    def unsupported(self, t):
        return "numpy has no bfloat16" if self.numpy and str(t.dtype) == "torch.bfloat16" \
            else None

    def run(self, t):
        if self.numpy:
            view = self._views.get(id(t))
            if view is None or view[0] is not t:
                view = self._views[id(t)] = (t, t.numpy())
            self.comm.all_reduce(view[1])
        else:
            self.comm.all_reduce(t)

    def close(self):
        self._views.clear()


class DistPeer:
    """``dist.all_reduce`` on a process group."""

    def __init__(self, name: str, dist, group):
        self.name, self.dist, self.group = name, dist, group

    def unsupported(self, t):
        return None

    def run(self, t):
        self.dist.all_reduce(t, group=self.group)

    def close(self):
        pass


class DefaultGroupPeer(DistPeer):
    """``dist.all_reduce`` on the default group (torch's frontend takes no group)."""

    def run(self, t):
        self.dist.all_reduce(t)


class DeepSpeedPeer:
    """DeepSpeed's CPU shared-memory all-reduce (its ShareMemCommBuilder op, what
    ``deepspeed.comm.inference_all_reduce`` calls on CPUs), set up as DeepSpeed does
    (LOCAL_SIZE, MASTER_ADDR, MASTER_PORT name its /dev/shm files), which this peer
    unlinks once every rank has mapped them."""
    name = "deepspeed"

    def __init__(self, comm, torch):
        self.torch, self.op, self.level, self.why = torch, None, 0, None
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            from deepspeed.comm.torch import build_shm_op
        except ImportError:
            self.why = "deepspeed is not installed"
            return
        host = np.array([zlib.crc32(socket.gethostname().encode())] * 2, np.int64)
        host[1] = -host[1]
        comm.all_reduce(host, "max")
        if host[0] != -host[1]:
            self.why = "ranks on several hosts (DeepSpeed's shm op is one host's)"
            return
        os.environ["LOCAL_SIZE"] = str(comm.size)
        tag = np.array([os.getpid()], np.int64)
        comm.broadcast(tag, 0)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "commlib-bench", str(tag[0])
        module = build_shm_op()
        if module is None:
            self.why = "DeepSpeed could not build its shm op here"
            return
        module.initialize(comm.size, comm.rank)
        self.level = module.vector_kernel_level()
        comm.barrier()  # every rank has mapped every rank's file: unlink them
        if comm.rank == 0:
            for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_commlib-bench_"
                                  f"{tag[0]}_*"):
                os.unlink(path)
        self.op = torch.ops.deepspeed.inference_all_reduce_

    def unsupported(self, t):
        if self.why:
            return self.why
        torch = self.torch
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"DeepSpeed's shm op has no {t.dtype}"
        # (DeepSpeed's own rule: 16-bit kernels need AVX-512BW, float32 AVX2; without, it
        # falls back to the process group)
        if self.level < (1 if t.dtype == torch.float32 else 2):
            return f"this CPU lacks the instructions DeepSpeed's {t.dtype} kernel needs"
        return None

    def run(self, t):
        self.op(t)

    def close(self):
        pass


def _peers(names, comm, group, dist, torch) -> list:
    made = []
    for name in names:
        if name in ("api:numpy", "api:torch"):
            made.append(ApiPeer(comm, name == "api:numpy"))
        elif name == "dist:commlib":
            made.append((DefaultGroupPeer if group is dist.group.WORLD else DistPeer)(
                name, dist, group))
        elif name == "dist:gloo":
            made.append(DistPeer(name, dist, dist.new_group(backend="gloo")))
        elif name == "deepspeed":
            made.append(DeepSpeedPeer(comm, torch))
        else:
            raise SystemExit(f"torch-latency: unknown peer {name!r}; use api:numpy, api:torch, "
                             "dist:commlib, dist:gloo, deepspeed")
    return made

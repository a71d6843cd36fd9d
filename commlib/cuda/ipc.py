"""All-reduce among the GPU ranks of one host through CUDA IPC: kernels read the peers'
device memory directly. Ranks may share a GPU (NCCL refuses that; it is how one-GPU
machines test this).

Vocabulary:
  workspace  device memory of each rank, two *slots* of ``slot_bytes``, which every peer
             maps once per communicator (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
  step       one slot-sized chunk of a call; steps are numbered across the communicator's
             calls, and step s uses slot s % 2.
  one-shot   every rank reduces the whole chunk, reading every workspace (2 ranks, small
             chunks: the fewest synchronisations).
  two-shot   rank r reduces part r of the chunk into its own slot; then every rank copies
             every part from its owner's slot (at 3+ ranks each rank reads less).
  counters   three words of pinned host memory the host raises and the stream waits for
             (cuStreamWaitValue32): ``go`` and ``go2`` (steps allowed to read the peers'
             slots, before and after the two-shot's reduction) and ``free`` (steps every
             rank is done with, so that their slot may be written again).

Synchronisation goes through the host, as for the staged calls: ranks that share a GPU take
turns on it, so a kernel spinning on a peer's flag would wait out its time slice. Per step
the caller's stream runs

    wait free >= s-1 -> copy the chunk into my slot -> record ready -> wait go >= s+1
    -> reduce (two-shot: record half -> wait go2 >= s+1 -> copy the parts)

and the communicator's progress engine, per step, waits for `ready`, meets the other
ranks (the shared-memory transport's agreement, which checks that they made the same
call, then barriers), and raises free to s and go to s+1 (two-shot: then waits for
`half`, meets them, raises go2). Meeting after my `ready` means every rank's stream has
finished the step before: its slot may be reused two steps on.
"""
from __future__ import annotations

import os

from ..calls import NONE, descriptor
from .staging import StagedWork, wait_event

SLOT_BYTES = 16 << 20  # per rank and slot; COMMLIB_CUDA_IPC_SLOT_BYTES overrides
MAX_RANKS = 16  # the reduce kernel's sources (kernels.cu kMaxSources)
ONE_SHOT_BYTES = 256 << 10  # at 3+ ranks, chunks up to this reduce in one shot
                             # (COMMLIB_CUDA_IPC_ONE_SHOT_BYTES overrides)
ALIGN = 256


def usable(comm, buf) -> bool:
    """Whether this all_reduce may take the IPC path (the same answer on every rank that
    makes the same call): GPU memory, ranks of one host sharing memory, 2 to 16 of them."""
    return (buf.device is not None and comm.transport == "shm" and 2 <= comm.size <= MAX_RANKS
            and os.environ.get("COMMLIB_CUDA_IPC", "1") != "0")


class IpcAllReduce:
    """A communicator's workspaces on one device, mapped by every rank, and its counters.
    Made collectively (``set_up``) on the communicator's engine thread."""

    def __init__(self, runtime, comm, device: int):
        self.rt, self.device, self.rank, self.size = runtime, device, comm.rank, comm.size
        self.slot_bytes = int(os.environ.get("COMMLIB_CUDA_IPC_SLOT_BYTES", SLOT_BYTES))
        self.slot_bytes = max(ALIGN, self.slot_bytes // ALIGN * ALIGN)
        self.workspace = self.counters = None
        self.peers: list[int] = []
        self.one_shot_bytes = int(os.environ.get("COMMLIB_CUDA_IPC_ONE_SHOT_BYTES",
                                                 ONE_SHOT_BYTES))
        self.step = 0  # steps issued so far
        self.usable = False
        self.problem = None  # why not, when set-up failed on some rank

    def set_up(self, group) -> None:
        """Allocate, exchange handles, map the peers' workspaces: all ranks or none."""
        rt, device = self.rt, self.device
        problem = None
        try:
            self.workspace = rt.device_alloc(2 * self.slot_bytes, device)
            handle = rt.ipc_handle(self.workspace, device).hex()
            uuid = rt.device_uuid(device).hex()
        except RuntimeError as e:
            problem, handle, uuid = str(e), None, None
        shared = group.allgather([handle, uuid, problem])
        problem = problem or next((p for _, _, p in shared if p), None)
        if problem is None:
            try:
                visible = {rt.device_uuid(d).hex(): d for d in range(_device_count(rt))}
                self.peers = [self.workspace if r == self.rank else
                              rt.ipc_open(bytes.fromhex(h), device)
                              for r, (h, u, _) in enumerate(shared)
                              if u in visible and rt.can_access(device, visible[u])]
                if len(self.peers) != self.size:
                    problem = "a peer's GPU is not reachable from this rank's"
            except RuntimeError as e:
                problem = str(e)
        problems = [p for p in group.allgather(problem) if p]
        if problems:
            self.close()
            self.problem = problems[0]
            return
        self.counters = rt.host_alloc(3 * 64)
        for k in range(3):
            rt.store_counter(self.counters + 64 * k, 0)
        self.usable = True

    @property
    def go(self):
        return self.counters

    @property
    def go2(self):
        return self.counters + 64

    @property
    def free(self):
        return self.counters + 128

    def close(self) -> None:
        rt, device = self.rt, self.device
        for ptr in self.peers:
            if ptr != self.workspace:
                rt.ipc_close(ptr, device)
        self.peers = []
        if self.workspace is not None:
            rt.device_free(self.workspace, device)
            self.workspace = None
        if self.counters is not None:
            rt.host_free(self.counters)
            self.counters = None
        self.usable = False

    def issue(self, comm, staging, buf, dtype, op_code: int, average: bool, async_op: bool,
              result, seconds: float, what: str):
        """Enqueue the all_reduce of ``buf`` (in place) and queue its host part on the
        communicator's engine; returns ``result``, or a StagedWork if ``async_op``."""
        rt, device, size, itemsize = self.rt, self.device, self.size, dtype.itemsize
        stream = staging.stream_for(buf.device, async_op)
        per_step = self.slot_bytes // itemsize
        count = buf.numel
        nsteps = max(1, -(-count // per_step))
        one_shot = size == 2 or min(count, per_step) * itemsize <= self.one_shot_bytes
        first = self.step
        self.step += nsteps
        waits = []  # per step: (ready, half or None)
        for i in range(nsteps):
            s, lo = first + i, i * per_step
            n = min(per_step, count - lo)
            offset = (s % 2) * self.slot_bytes
            mine, out = self.workspace + offset, buf.ptr + lo * itemsize
            slots = [p + offset for p in self.peers]
            if s >= 2:
                rt.wait_value(stream, device, self.free, s - 1)
            rt.copy_async(mine, out, n * itemsize, device, stream)
            ready = rt.Event(device)
            ready.record(stream)
            rt.wait_value(stream, device, self.go, s + 1)
            half = None
            if one_shot:
                rt.reduce_n(out, slots, n, dtype.code, op_code, device, stream)
            else:
                parts = _parts(n, size, itemsize)
                a, b = parts[self.rank]
                rt.reduce_n(mine + a * itemsize, [p + a * itemsize for p in slots], b - a,
                            dtype.code, op_code, device, stream)
                half = rt.Event(device)
                half.record(stream)
                rt.wait_value(stream, device, self.go2, s + 1)
                for (a, b), slot in zip(parts, slots):
                    rt.copy_async(out + a * itemsize, slot + a * itemsize, (b - a) * itemsize,
                                  device, stream)
            waits.append((ready, half))
        if average:
            rt.scale(buf.ptr, 1.0 / size, count, dtype.code, device, stream)
        done = rt.Event(device)
        done.record(stream)
        staging.keep_until(done, [buf.obj])

        name = "oneshot" if one_shot else "twoshot"  # the flight recorder's algorithm
        record = comm._recorder.issue("all_reduce", name, count, dtype.name,
                                      _op_name(op_code), None)
        desc = descriptor("all_reduce", name, count, dtype.code, op_code, NONE)
        executor = comm._executor

        def body():
            if executor.timeout != seconds:
                executor.set_timeout(seconds)
            transport = executor.transport
            for i, (ready, half) in enumerate(waits):
                s = first + i
                wait_event(ready, seconds, what)
                if i == 0:
                    transport.agree(desc, [], [], itemsize)
                else:
                    transport.barrier()
                rt.store_counter(self.free, s)
                rt.store_counter(self.go, s + 1)
                if half is not None:
                    wait_event(half, seconds, what)
                    transport.barrier()
                    rt.store_counter(self.go2, s + 1)

        def task():
            try:
                comm._run_recorded(record, what, body)
            except BaseException as e:
                if staging.failure is None:
                    staging.failure = e
                for counter in (self.free, self.go, self.go2):  # no stream waits forever
                    rt.store_counter(counter, first + nsteps)
                raise

        host_work = comm._engine.run(what, task, async_op=True)
        if async_op:
            return StagedWork(what, host_work, done, buf.device, result, staging)
        return result


def _parts(n: int, size: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's part of n elements: whole 16-byte vectors where possible."""
    per_vector = max(1, 16 // itemsize)
    part = -(-(-(-n // size)) // per_vector) * per_vector
    return [(min(n, r * part), min(n, (r + 1) * part)) for r in range(size)]


def _device_count(rt) -> int:
    return rt.device_count() if hasattr(rt, "device_count") else 1


def _op_name(op_code: int) -> str:
    from . import OPS
    return OPS[op_code]

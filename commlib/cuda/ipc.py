"""all_reduce, reduce_scatter, all_gather, all_to_all, broadcast and reduce among
the GPU ranks of one host through CUDA IPC: kernels and copies read the peers' device memory
directly. Ranks may share a GPU (NCCL refuses that; it is how one-GPU machines test this).

Vocabulary:
  workspace  device memory of each rank, two *slots* of ``slot_bytes``, which every peer
             maps once per communicator (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
  step       one slot-sized chunk of a call; steps are numbered across the communicator's
             calls, and step s uses slot s % 2.
  phase      what a step does on the stream before the ranks first meet (fill my slot),
             between meetings, and after the last (read the peers' slots).
  meeting    every rank's stream has finished the phase before: the host sees its event
             pass, the ranks meet on the shared-memory transport (its agreement for a
             call's first meeting, which checks that they made the same call, then
             barriers), and a counter goes up that lets the streams go on.
  counters   words of pinned host memory the host raises and the streams wait for
             (cuStreamWaitValue32): ``go`` (one per meeting of a step: steps allowed past
             it) and ``free`` (steps every rank is done with, so that their slot may be
             written again; a step's first meeting frees the step before it).
  one-shot   all_reduce where every rank reduces the whole chunk from every slot (2 ranks,
             small chunks: one meeting).
  two-shot   all_reduce where rank r reduces part r of the chunk into its own slot and its
             output, and after a second meeting every rank copies the other parts from
             their owners' slots (at 3+ ranks each rank reads less).
  on the host  a call of one step whose work the host enqueues on our stream (``side``)
             between its two meetings, once the ranks have agreed on it, and waits for:
             all_to_all, whose steps depend on every rank's splits, and the zero-copy calls.
             It may use both slots: by call order, the calls before it are done on every
             rank, and those after it wait for its second meeting.
  zero-copy  a call whose input lies in registered memory (Communicator.register) at every
             rank: each rank reads the peers' inputs where they lie and writes its own
             output, with no slot in between. all_reduce (in place) has rank r reduce part
             r of every rank's buffer and write it into all of them, in one kernel.
  call order the calls of a communicator share the slots and counters, so they run in call
             order on the GPU too: a call on another stream than the last waits for it.

Synchronisation goes through the host, as for the staged calls: ranks that share a GPU take
turns on it, so a kernel spinning on a peer's flag would wait out its time slice.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from ..calls import NONE, descriptor
from . import MAX_POINTERS, OPS
from .registered import Registrations
from .staging import wait_event

SLOT_BYTES = 16 << 20  # per rank and slot; COMMLIB_CUDA_IPC_SLOT_BYTES overrides
MAX_RANKS = MAX_POINTERS  # a rank's reduce kernel reads (and writes) every rank's memory
ONE_SHOT_BYTES = 256 << 10  # at 3+ ranks, chunks up to this reduce in one shot
                             # (COMMLIB_CUDA_IPC_ONE_SHOT_BYTES overrides)
ALIGN = 256


def usable(comm, *bufs) -> bool:
    """Whether a call on ``bufs`` may take the IPC path (the same answer on every rank that
    makes the same call): GPU memory on one device, ranks of one host sharing memory, 2 to
    16 of them."""
    return (all(b.device is not None for b in bufs)
            and len({b.device.device for b in bufs}) == 1
            and comm.transport == "shm" and 2 <= comm.size <= MAX_RANKS
            and os.environ.get("COMMLIB_CUDA_IPC", "1") != "0")


class IpcCollectives:
    """A communicator's workspaces on one device, mapped by every rank, its counters, and
    the collectives over them. Made collectively (``set_up``) on the communicator's engine
    thread."""

    def __init__(self, runtime, comm, device: int):
        self.rt, self.device, self.rank, self.size = runtime, device, comm.rank, comm.size
        self.slot_bytes = int(os.environ.get("COMMLIB_CUDA_IPC_SLOT_BYTES", SLOT_BYTES))
        self.slot_bytes = max(ALIGN, self.slot_bytes // ALIGN * ALIGN)
        self.workspace = self.counters = None
        self.peers: list[int] = []
        self.one_shot_bytes = int(os.environ.get("COMMLIB_CUDA_IPC_ONE_SHOT_BYTES",
                                                 ONE_SHOT_BYTES))
        self.step = 0  # steps issued so far
        self.side = None  # our stream: the work of calls on the host
        self.tail = None  # (event after the last call's work, its stream)
        self.registered = Registrations(runtime, device, comm.rank)
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
                visible = {rt.device_uuid(d).hex(): d for d in range(rt.device_count())}
                for r, (h, u, _) in enumerate(shared):
                    if u not in visible or not rt.can_access(device, visible[u]):
                        problem = f"rank {r}'s GPU is not reachable from rank {self.rank}'s"
                        break
                    self.peers.append(self.workspace if r == self.rank else
                                      rt.ipc_open(bytes.fromhex(h), device))
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
        self.side = rt.stream_create(device)
        self.usable = True

    @property
    def go(self) -> tuple[int, int]:
        return self.counters, self.counters + 64

    @property
    def free(self) -> int:
        return self.counters + 128

    def close(self) -> None:
        rt, device = self.rt, self.device
        self.registered.close()
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

    # The collectives: each cuts its call into steps and says what a step does in each
    # phase (before the first meeting of the ranks, after it, after the second); or, with
    # its input registered at every rank, enqueues its zero-copy work on the host.
    def all_reduce(self, call: "Call", buf, op_code: int, average: bool, root=None):
        """``buf`` reduced in place. With ``root``, a reduce: only the root reduces (in one
        shot); the others lend their data."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, code, count = call.dtype.itemsize, call.dtype.code, buf.numel
        keeps = root is None or rank == root  # this rank ends with the reduction
        after = self._scaled(call, buf, average and keeps)
        root = NONE if root is None else root
        placed = self.registered.of(buf)
        if placed is not None:
            def zero_copy(ptrs, group):
                if root == NONE:  # part r of every buffer is rank r's alone
                    a, b = _parts(count, size, itemsize)[rank]
                    if b > a:
                        part = [p + a * itemsize for p in ptrs]
                        rt.reduce_n(part, part, b - a, code, op_code, device, self.side)
                elif keeps:
                    rt.reduce_n([buf.ptr], ptrs, count, code, op_code, device, self.side)
            return self._zero_copy(call, count, op_code, root, placed, zero_copy, after)
        per_step = self.slot_bytes // itemsize
        one_shot = (root != NONE or size == 2
                    or min(count, per_step) * itemsize <= self.one_shot_bytes)

        def step(i, mine, slots):
            lo = i * per_step
            n = min(per_step, count - lo)
            out = buf.ptr + lo * itemsize
            fill = lambda st: rt.copy_async(mine, out, n * itemsize, device, st)  # noqa: E731
            if not keeps:
                return [fill, lambda st: None]
            if one_shot:
                return [fill, lambda st: rt.reduce_n([out], slots, n, code, op_code, device, st)]
            parts = _parts(n, size, itemsize)
            a, b = parts[rank]

            def gather(st):  # the others' parts (mine went straight into out)
                for r, ((a, b), slot) in enumerate(zip(parts, slots)):
                    if r != rank:
                        rt.copy_async(out + a * itemsize, slot + a * itemsize,
                                      (b - a) * itemsize, device, st)
            return [fill, lambda st: rt.reduce_n([mine + a * itemsize, out + a * itemsize],
                                                 [p + a * itemsize for p in slots], b - a,
                                                 code, op_code, device, st), gather]
        algorithm = "ipc" if root != NONE else "oneshot" if one_shot else "twoshot"
        return self.run(call, algorithm, count, op_code, root, _steps(count, per_step), step,
                        after)

    def reduce_scatter(self, call: "Call", out, inp, op_code: int, average: bool):
        """Step i: rank r copies piece i of each of its blocks into its slot, then reduces
        piece i of block r from every slot."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, code, m = call.dtype.itemsize, call.dtype.code, out.numel
        after = self._scaled(call, out, average)
        placed = self.registered.of(inp)
        if placed is not None:
            def zero_copy(ptrs, group):
                rt.reduce_n([out.ptr], [p + rank * m * itemsize for p in ptrs], m, code,
                            op_code, device, self.side)
            return self._zero_copy(call, m, op_code, NONE, placed, zero_copy, after)
        per_step = max(1, self.slot_bytes // itemsize // size)

        def step(i, mine, slots):
            lo = i * per_step
            k = min(per_step, m - lo)

            def fill(st):  # piece i of each block j into region j of my slot
                for j in range(size):
                    rt.copy_async(mine + j * k * itemsize, inp.ptr + (j * m + lo) * itemsize,
                                  k * itemsize, device, st)
            return [fill, lambda st: rt.reduce_n([out.ptr + lo * itemsize],
                                                 [p + rank * k * itemsize for p in slots], k,
                                                 code, op_code, device, st)]
        return self.run(call, "ipc", m, op_code, NONE, _steps(m, per_step), step, after)

    def all_gather(self, call: "Call", out, inp):
        """Step i: every rank copies piece i of its input into its slot, then every slot's
        piece into its block of the output."""
        rt, device, itemsize, m = self.rt, self.device, call.dtype.itemsize, inp.numel
        placed = self.registered.of(inp)
        if placed is not None:
            def zero_copy(ptrs, group):
                for r, p in enumerate(ptrs):
                    block = out.ptr + r * m * itemsize
                    if block != p:  # in place, my input is my output's block already
                        rt.copy_async(block, p, m * itemsize, device, self.side)
            return self._zero_copy(call, m, NONE, NONE, placed, zero_copy)
        per_step = self.slot_bytes // itemsize

        def step(i, mine, slots):
            lo = i * per_step
            k = min(per_step, m - lo)

            def gather(st):
                for r, slot in enumerate(slots):
                    rt.copy_async(out.ptr + (r * m + lo) * itemsize, slot, k * itemsize,
                                  device, st)
            return [lambda st: rt.copy_async(mine, inp.ptr + lo * itemsize, k * itemsize,
                                             device, st), gather]
        return self.run(call, "ipc", m, NONE, NONE, _steps(m, per_step), step)

    def broadcast(self, call: "Call", buf, root: int):
        rt, device, itemsize, count = self.rt, self.device, call.dtype.itemsize, buf.numel
        at_root = self.rank == root
        placed = self.registered.of(buf)
        if placed is not None:
            def zero_copy(ptrs, group):
                if not at_root:
                    rt.copy_async(buf.ptr, ptrs[root], buf.nbytes, device, self.side)
            return self._zero_copy(call, count, NONE, root, placed, zero_copy)
        per_step = self.slot_bytes // itemsize

        def step(i, mine, slots):
            lo = i * per_step
            n = min(per_step, count - lo)
            chunk = buf.ptr + lo * itemsize
            if at_root:
                return [lambda st: rt.copy_async(mine, chunk, n * itemsize, device, st),
                        lambda st: None]
            return [lambda st: None,
                    lambda st: rt.copy_async(chunk, slots[root], n * itemsize, device, st)]
        return self.run(call, "ipc", count, NONE, root, _steps(count, per_step), step)

    def all_to_all(self, call: "Call", out, inp, out_splits: tuple, in_splits: tuple):
        """Rank r's part j of ``inp`` (in_splits[j] elements) into rank j's output, at its
        part r. Through the slots, on the host: step i has every rank copy piece i of its
        part for rank j into region j of its slot, and after a meeting, piece i of region
        r of every rank's slot into its output; the two slots take turns, so that one
        meeting per step suffices. Our own part goes straight from input to output."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, side = call.dtype.itemsize, self.side
        send, recv = _starts(in_splits), _starts(out_splits)
        splits = ([k * itemsize for k in in_splits], [k * itemsize for k in out_splits])
        placed = self.registered.of(inp)
        if placed is not None:
            def zero_copy(ptrs, group):
                inputs = group.allgather(in_splits)  # where my part lies in each input
                for j, p in enumerate(ptrs):
                    if out_splits[j]:
                        rt.copy_async(out.ptr + recv[j] * itemsize,
                                      p + sum(inputs[j][:rank]) * itemsize,
                                      out_splits[j] * itemsize, device, side)
            return self._zero_copy(call, inp.numel, NONE, NONE, placed, zero_copy,
                                   splits=splits)
        per = max(1, self.slot_bytes // size // itemsize)  # elements per region and step

        def fill(i):
            mine = self.workspace + i % 2 * self.slot_bytes
            for j in range(size):
                lo, k = _piece(i, per, in_splits[j])
                if k and j != rank:
                    rt.copy_async(mine + j * per * itemsize, inp.ptr + (send[j] + lo) * itemsize,
                                  k * itemsize, device, side)

        def gather(i):
            region = i % 2 * self.slot_bytes + rank * per * itemsize
            for j in range(size):
                lo, k = _piece(i, per, out_splits[j])
                if k:
                    source = (inp.ptr + (send[rank] + lo) * itemsize if j == rank
                              else self.peers[j] + region)
                    rt.copy_async(out.ptr + (recv[j] + lo) * itemsize, source, k * itemsize,
                                  device, side)

        def work(transport, group):
            nsteps = _steps(max(group.allgather(max(in_splits))), per)
            fill(0)
            for i in range(nsteps):
                self._drain(call)  # my fill of step i and gather of step i - 1 are done,
                transport.barrier()  # and every rank's: slot i % 2 is full, the other free
                gather(i)
                if i + 1 < nsteps:
                    fill(i + 1)
        return self._on_host(call, "ipc", inp.numel, NONE, NONE, work, splits=splits)

    def _scaled(self, call: "Call", buf, average: bool):
        """The phase after a call that averages: ``buf`` divided by the number of ranks."""
        if not average:
            return None
        return lambda st: self.rt.scale(buf.ptr, 1.0 / self.size, buf.numel, call.dtype.code,
                                        self.device, st)

    def _zero_copy(self, call: "Call", count: int, op_code, root, placed, enqueue, after=None,
                   splits=([], [])):
        """A call on registered memory, on the host: ``enqueue(ptrs, group)`` enqueues its
        work on our stream, once ``ptrs`` says where every rank's input lies (``placed``:
        where mine does, in which registration)."""
        def work(transport, group):
            enqueue(self.registered.placed(group, *placed), group)
        return self._on_host(call, "zerocopy", count, op_code, root, work, after, splits)

    def _on_host(self, call: "Call", algorithm: str, count: int, op_code, root, work,
                 after=None, splits=([], [])):
        """A call of one step whose ``work(transport, group)`` the host does between its
        meetings, enqueueing on our stream; the caller's stream waits for the second
        meeting, which follows our stream's end of that work on every rank."""
        def between(transport, group):
            work(transport, group)
            self._drain(call)
        nothing = lambda st: None  # noqa: E731
        return self.run(call, algorithm, count, op_code, root, 1,
                        lambda i, mine, slots: [nothing, nothing], after, between, splits)

    def _drain(self, call: "Call") -> None:
        """Wait until our stream has done what it holds."""
        drained = self.rt.Event(self.device)
        drained.record(self.side)
        wait_event(drained, call.seconds, f"{call.collective} (ipc)")

    def run(self, call: "Call", algorithm: str, count: int, op_code, root, nsteps: int, step,
            after=None, between=None, splits=([], [])):
        """Enqueue ``nsteps`` steps (``step(i, my slot, every rank's slot)`` gives step i's
        phases, each a function of the stream) and then ``after``; queue the meetings on
        the communicator's engine. ``between(transport, group)``, if given, is host work
        of a one-step call between its two meetings; ``splits`` (all_to_all's, in bytes)
        are agreed on with the call. Returns the call's result, or a StagedWork if async."""
        rt, device, comm, staging = self.rt, self.device, call.comm, call.staging
        stream = staging.stream_for(call.array, call.async_op)
        if self.tail is not None and self.tail[1] != stream:
            # the calls share the slots and counters, so they run in call order on the GPU
            # too: a call on another stream would otherwise refill a slot still being read
            self.tail[0].wait(stream)
        first = self.step
        self.step += nsteps
        meetings = []  # per step: the event each meeting waits for
        for i in range(nsteps):
            s = first + i
            offset = (s % 2) * self.slot_bytes
            phases = step(i, self.workspace + offset, [p + offset for p in self.peers])
            if s >= 2:
                rt.wait_value(stream, device, self.free, s - 1)
            events = []
            for k, phase in enumerate(phases):
                if k:  # the ranks meet: wait for the host to say that all got here
                    events.append(rt.Event(device))
                    events[-1].record(stream)
                    rt.wait_value(stream, device, self.go[k - 1], s + 1)
                phase(stream)
            meetings.append(events)
        if after is not None:
            after(stream)
        done = rt.Event(device)
        done.record(stream)
        self.tail = (done, stream)
        staging.keep_until(done, call.keep)

        op = OPS[op_code] if op_code != NONE else None
        record = comm._recorder.issue(call.collective, algorithm, count, call.dtype.name, op,
                                      None if root == NONE else root)
        desc = descriptor(call.collective, algorithm, count, call.dtype.code, op_code, root)
        executor, seconds, what = comm._executor, call.seconds, f"{call.collective} (ipc)"

        def body():
            if executor.timeout != seconds:
                executor.set_timeout(seconds)
            transport = executor.transport
            for i, events in enumerate(meetings):
                s = first + i
                for k, event in enumerate(events):
                    wait_event(event, seconds, what)
                    if i == 0 and k == 0:
                        transport.agree(desc, *splits, call.dtype.itemsize)
                    else:
                        transport.barrier()
                    if k == 0:  # every rank is past step s - 1: its slot may be refilled
                        rt.store_counter(self.free, s)
                        if between is not None:  # host work, then the ranks meet again
                            between(transport, executor.group)
                            transport.barrier()
                    rt.store_counter(self.go[k], s + 1)

        def task():
            try:
                comm._run_recorded(record, what, body)
            except BaseException as e:
                staging.remember(e)
                for counter in (self.free, *self.go):  # no stream may wait forever
                    rt.store_counter(counter, first + nsteps)
                raise

        return staging.submit(comm._engine, what, task, done, call.array, call.async_op,
                              call.result)


class Call(NamedTuple):
    """What run() needs of a public call besides its steps."""
    comm: object
    staging: object
    collective: str
    array: object  # the cuda.DeviceArray that names the device and the caller's stream
    dtype: object  # buffers.DType
    async_op: bool
    result: object
    seconds: float
    keep: list  # the user's arrays, alive until the stream is done with them


def _steps(count: int, per_step: int) -> int:
    return max(1, -(-count // per_step))


def _starts(splits) -> list[int]:
    """Where each part of a buffer cut by ``splits`` starts."""
    starts = [0]
    for k in splits[:-1]:
        starts.append(starts[-1] + k)
    return starts


def _piece(i: int, per: int, count: int) -> tuple[int, int]:
    """Where piece i (of ``per`` elements) of a part of ``count`` starts, and its length."""
    lo = i * per
    return lo, max(0, min(per, count - lo))


def _parts(n: int, size: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's part of n elements: whole 16-byte vectors where possible."""
    per_vector = max(1, 16 // itemsize)
    per_rank = -(-n // size)
    part = -(-per_rank // per_vector) * per_vector
    return [(min(n, r * part), min(n, (r + 1) * part)) for r in range(size)]

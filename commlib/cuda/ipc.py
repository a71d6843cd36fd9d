"""all_reduce, reduce_scatter, all_gather, all_to_all (equal parts), broadcast and reduce among
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
  two-shot   all_reduce where rank r reduces part r of the chunk into its own slot, and after
             a second meeting every rank copies every part from its owner's slot (at 3+
             ranks each rank reads less).
  registered memory that the user registered (Communicator.register): every peer maps it,
             so an all_reduce on it needs no slot (zero-copy). Rank r reduces part r of every
             rank's buffer and writes it into all of them (one kernel), on a stream of ours that the
             host feeds between the two meetings, once it knows where the peers' buffers
             are; the caller's stream waits for the second meeting.

Synchronisation goes through the host, as for the staged calls: ranks that share a GPU take
turns on it, so a kernel spinning on a peer's flag would wait out its time slice.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from ..calls import NONE, descriptor
from . import MAX_POINTERS, OPS
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
        self.side = None  # our stream: the registered all_reduce's kernels
        self.tail = None  # (event after the last call's work, its stream)
        self.registrations: dict[int, Registration] = {}  # by index, the same on every rank
        self._registered = 0  # registrations made so far
        self._mapped: dict[str, list] = {}  # a peer's allocation: handle -> [address, users]
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
        for registration in list(self.registrations.values()):
            self._forget(registration)
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

    # Registered memory. Both calls run on the communicator's engine, on every rank alike.
    def register(self, group, ptr: int, nbytes: int) -> "Registration":
        """Every rank shares the allocation that holds its [ptr, ptr + nbytes) and maps the
        peers'; all ranks succeed or all raise."""
        rt, device = self.rt, self.device
        problem = handle = None
        offset = 0
        try:
            base, _ = rt.address_range(ptr, device)
            handle, offset = rt.ipc_handle(base, device).hex(), ptr - base
        except RuntimeError as e:
            problem = f"rank {self.rank} cannot share its memory through CUDA IPC: {e}"
        shared = group.allgather([handle, offset, problem])
        problem = next((p for _, _, p in shared if p), None)
        peers, mapped = [], []
        if problem is None:
            try:
                for r, (h, o, _) in enumerate(shared):
                    if r == self.rank:
                        peers.append(ptr)
                    else:
                        peers.append(self._map(h) + o)
                        mapped.append(h)
            except RuntimeError as e:
                problem = f"rank {self.rank} cannot map a peer's memory: {e}"
        problems = [p for p in group.allgather(problem) if p]
        if problems:
            for h in mapped:
                self._unmap(h)
            raise RuntimeError(problems[0])
        registration = Registration(self._registered, ptr, nbytes, peers, mapped)
        self._registered += 1
        self.registrations[registration.index] = registration
        return registration

    def deregister(self, group, registration: "Registration") -> None:
        """After every rank's calls before it (a collective, so no peer still reads it)."""
        group.allgather(None)
        self._forget(registration)

    def registration_of(self, buf) -> "tuple[Registration, int] | None":
        """The registration that holds all of ``buf``, and where in it ``buf`` starts."""
        for registration in self.registrations.values():
            offset = buf.ptr - registration.ptr
            if 0 <= offset and offset + buf.nbytes <= registration.nbytes:
                return registration, offset
        return None

    def _map(self, handle: str) -> int:
        """A peer's allocation, mapped once however many registrations it holds (CUDA
        maps a handle once per process)."""
        if handle not in self._mapped:
            self._mapped[handle] = [self.rt.ipc_open(bytes.fromhex(handle), self.device), 0]
        self._mapped[handle][1] += 1
        return self._mapped[handle][0]

    def _unmap(self, handle: str) -> None:
        entry = self._mapped[handle]
        entry[1] -= 1
        if entry[1] == 0:
            self.rt.ipc_close(entry[0], self.device)
            del self._mapped[handle]

    def _forget(self, registration: "Registration") -> None:
        if self.registrations.pop(registration.index, None) is not None:
            for h in registration.mapped:
                self._unmap(h)

    # The collectives: each cuts its call into steps and says what a step does in each
    # phase (before the first meeting of the ranks, after it, after the second).
    def all_reduce(self, call: "Call", buf, op_code: int, average: bool, root=None):
        """``buf`` reduced in place. With ``root``, a reduce: only the root reduces (in one
        shot); the others lend their data."""
        placed = self.registration_of(buf) if root is None else None
        if placed is not None:
            return self._all_reduce_registered(call, buf, *placed, op_code, average)
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, code = call.dtype.itemsize, call.dtype.code
        per_step, count = self.slot_bytes // itemsize, buf.numel
        one_shot = (root is not None or size == 2
                    or min(count, per_step) * itemsize <= self.one_shot_bytes)
        keeps = root is None or rank == root  # this rank ends with the reduction

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
        after = (lambda st: rt.scale(buf.ptr, 1.0 / size, count, code, device, st)) \
            if average and keeps else None
        algorithm = "ipc" if root is not None else "oneshot" if one_shot else "twoshot"
        return self.run(call, algorithm, count, op_code, NONE if root is None else root,
                        _steps(count, per_step), step, after)

    def reduce_scatter(self, call: "Call", out, inp, op_code: int, average: bool):
        """Step i: rank r copies piece i of each of its blocks into its slot, then reduces
        piece i of block r from every slot."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, code, m = call.dtype.itemsize, call.dtype.code, out.numel
        per_step = max(1, self.slot_bytes // itemsize // size)

        def step(i, mine, slots):
            lo = i * per_step
            k = min(per_step, m - lo)
            return [self._fill_regions(mine, inp, m, lo, k, itemsize),
                    lambda st: rt.reduce_n([out.ptr + lo * itemsize],
                                           [p + rank * k * itemsize for p in slots], k,
                                           code, op_code, device, st)]
        after = (lambda st: rt.scale(out.ptr, 1.0 / size, m, code, device, st)) \
            if average else None
        return self.run(call, "ipc", m, op_code, NONE, _steps(m, per_step), step, after)

    def all_gather(self, call: "Call", out, inp):
        """Step i: every rank copies piece i of its input into its slot, then every slot's
        piece into its block of the output."""
        rt, device, itemsize, m = self.rt, self.device, call.dtype.itemsize, inp.numel
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

    def all_to_all(self, call: "Call", out, inp):
        """Equal parts of m elements. Step i: every rank copies piece i of each of its parts
        into its slot (the part for rank j in region j), then piece i of region r of every
        rank's slot into its output."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, m = call.dtype.itemsize, out.numel // size
        per_step = max(1, self.slot_bytes // itemsize // size)

        def step(i, mine, slots):
            lo = i * per_step
            k = min(per_step, m - lo)

            def gather(st):
                for j, slot in enumerate(slots):
                    rt.copy_async(out.ptr + (j * m + lo) * itemsize, slot + rank * k * itemsize,
                                  k * itemsize, device, st)
            return [self._fill_regions(mine, inp, m, lo, k, itemsize), gather]
        return self.run(call, "ipc", m, NONE, NONE, _steps(m, per_step), step)

    def _all_reduce_registered(self, call: "Call", buf, registration: "Registration",
                               offset: int, op_code: int, average: bool):
        """Zero-copy, one step. After the first meeting the host learns where every rank's
        buffer lies in its registration and enqueues on our stream: reduce part r of all of
        them into mine, copy it into the peers'. Part r of every buffer is rank r's alone,
        and no rank's stream goes on until the second meeting (all parts written)."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, code, count = call.dtype.itemsize, call.dtype.code, buf.numel
        seconds, what = call.seconds, f"{call.collective} (ipc)"

        def between(transport, group):
            placed = group.allgather((registration.index, offset))
            ptrs = [self.registrations[k].peers[r] + o for r, (k, o) in enumerate(placed)]
            a, b = _parts(count, size, itemsize)[rank]
            if b > a:
                part = [p + a * itemsize for p in ptrs]
                rt.reduce_n(part, part, b - a, code, op_code, device, self.side)
            pushed = rt.Event(device)
            pushed.record(self.side)
            wait_event(pushed, seconds, what)
        after = (lambda st: rt.scale(buf.ptr, 1.0 / size, count, code, device, st)) \
            if average else None
        return self.run(call, "zerocopy", count, op_code, NONE, 1,
                        lambda i, mine, slots: [lambda st: None, lambda st: None], after,
                        between)

    def _fill_regions(self, mine: int, inp, m: int, lo: int, k: int, itemsize: int):
        """The phase that copies piece [lo, lo + k) of each of ``inp``'s blocks of m
        elements (block j: for rank j) into region j of my slot."""
        def fill(st):
            for j in range(self.size):
                self.rt.copy_async(mine + j * k * itemsize, inp.ptr + (j * m + lo) * itemsize,
                                   k * itemsize, self.device, st)
        return fill

    def broadcast(self, call: "Call", buf, root: int):
        rt, device, itemsize, count = self.rt, self.device, call.dtype.itemsize, buf.numel
        per_step = self.slot_bytes // itemsize
        at_root = self.rank == root

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

    def run(self, call: "Call", algorithm: str, count: int, op_code, root, nsteps: int, step,
            after=None, between=None):
        """Enqueue ``nsteps`` steps (``step(i, my slot, every rank's slot)`` gives step i's
        phases, each a function of the stream) and then ``after``; queue the meetings on
        the communicator's engine. ``between(transport, group)``, if given, is host work
        of a one-step call between its two meetings. Returns the call's result, or a
        StagedWork if async."""
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
                        transport.agree(desc, [], [], call.dtype.itemsize)
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


class Registration(NamedTuple):
    """Memory that every rank registered (Communicator.register), as this rank sees it."""
    index: int  # the same registration on every rank
    ptr: int
    nbytes: int
    peers: list  # by rank: where its registered memory is mapped here
    mapped: list  # the peers' allocation handles mapped for it


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


def _parts(n: int, size: int, itemsize: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's part of n elements: whole 16-byte vectors where possible."""
    per_vector = max(1, 16 // itemsize)
    per_rank = -(-n // size)
    part = -(-per_rank // per_vector) * per_vector
    return [(min(n, r * part), min(n, (r + 1) * part)) for r in range(size)]

"""cuda_ipc: the collectives among the GPU ranks of one host through CUDA IPC: kernels and
copies read the peers' device memory directly. Ranks may share a GPU (NCCL refuses that;
it is how one-GPU machines test this). One transport per device, beside the communicator's
shm transport (the *host*), whose agreement and barriers are its meetings; its algorithms
are registered in commlib/algorithms/ipc.py.

Vocabulary:
  workspace  device memory of each rank, two *slots* of ``slot_bytes``, which every peer
             maps once per communicator (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
  step       one slot-sized chunk of a call; steps are numbered across the communicator's
             calls, and step s uses slot s % 2.
  phase      what a step does on the stream before the ranks first meet (fill my slot),
             between meetings, and after the last (read the peers' slots).
  meeting    every rank's stream has finished the phase before: the host sees its event
             pass, the ranks meet on the host (agreement for a call's first meeting, then
             barriers), and a counter goes up that lets the streams go on.
  counters   words of pinned host memory the host raises and the streams wait for
             (cuStreamWaitValue32): ``go`` (one per meeting of a step: steps allowed past
             it) and ``free`` (steps every rank is done with, so that their slot may be
             written again; a step's first meeting frees the step before it).
  one-shot   all_reduce where every rank reduces the whole chunk from every slot; two-shot:
             rank r reduces part r, and every rank copies the others after a second
             meeting (commlib/algorithms/ipc.py chooses).
  on the host  a call of one step whose work the host enqueues on our stream (``side``)
             between its two meetings and waits for: all_to_all (its steps depend on every
             rank's splits) and zero-copy. It may use both slots: by call order, the calls
             before it are done on every rank, and those after it wait for it.
  zero-copy  a call whose input lies in registered memory (Communicator.register) at every
             rank: each rank reads the peers' inputs where they lie, with no slot between.
  call order the calls of a communicator share the slots and counters, so they run in call
             order on the GPU too: a call on another stream than the last waits for it.

Synchronisation goes through the host, as for the staged calls: ranks that share a GPU take
turns on it, so a kernel spinning on a peer's flag would wait out its time slice.
"""
from __future__ import annotations

import os

from ..algorithms import Where
from ..cuda import MAX_POINTERS
from ..cuda.registered import Registrations
from ..cuda.staging import wait_event
from .base import Transport

SLOT_BYTES = 16 << 20  # per rank and slot; COMMLIB_CUDA_IPC_SLOT_BYTES overrides
MAX_RANKS = MAX_POINTERS  # a rank's reduce kernel reads (and writes) every rank's memory
ONE_SHOT_BYTES = 256 << 10  # at 3+ ranks, chunks up to this reduce in one shot
                             # (COMMLIB_CUDA_IPC_ONE_SHOT_BYTES overrides)
ALIGN = 256


class CudaIpc(Transport):
    """A communicator's workspaces and counters on one device, and the collectives over
    them; set up collectively on the communicator's engine thread."""

    name = "cuda_ipc"
    offers = frozenset({"cuda_ipc"})

    def __init__(self, host, device: int, runtime):
        super().__init__(host.world)
        self.host, self.rt, self.device = host, runtime, device
        self.slot_bytes = int(os.environ.get("COMMLIB_CUDA_IPC_SLOT_BYTES", SLOT_BYTES))
        self.slot_bytes = max(ALIGN, self.slot_bytes // ALIGN * ALIGN)
        self.workspace = self.counters = None
        self.peers: list[int] = []
        self.one_shot_bytes = int(os.environ.get("COMMLIB_CUDA_IPC_ONE_SHOT_BYTES",
                                                 ONE_SHOT_BYTES))
        self.where = Where(self.name, slot_bytes=self.slot_bytes,
                           one_shot_bytes=self.one_shot_bytes)
        self.step = 0  # steps issued so far
        self.side = None  # our stream: the work of calls on the host
        self.tail = None  # (event after the last call's work, its stream)
        self.registered = Registrations(runtime, device, self.rank)
        self.usable = False
        self.problem = None  # why not, when set-up failed on some rank

    @staticmethod
    def suits(host) -> bool:
        """Whether ``host``'s GPU calls may come here: shm, 2 to 16 ranks, COMMLIB_CUDA_IPC."""
        return ("shm" in host.offers and 2 <= host.size <= MAX_RANKS
                and os.environ.get("COMMLIB_CUDA_IPC", "1") != "0")

    # its meetings are the host's
    def agree(self, desc, splits=None, itemsize=1) -> None:
        self.host.agree(desc, splits, itemsize)

    def barrier(self) -> None:
        self.host.barrier()

    @property
    def bytes_sent(self) -> int:
        return 0  # peers read our memory: nothing is sent

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
    def issue(self, call, algorithm: str, stream: int, seconds: float):
        """Enqueue ``call`` by ``algorithm`` (commlib/algorithms/ipc.py) on ``stream``; returns
        (``meet(desc)``: the host's part, for the engine; ``release()``: lets the streams go
        on if that fails; the event after the call's work)."""
        if algorithm == "zerocopy":
            buf = call.inp if call.inp is not None else call.out
            return self._zero_copy(call, self.registered.of(buf), stream, seconds)
        if call.collective == "all_reduce":
            return self._all_reduce(call, algorithm == "oneshot", stream, seconds)
        return getattr(self, "_" + call.collective)(call, stream, seconds)

    def _all_reduce(self, call, one_shot: bool, stream, seconds, root=None):
        """``call.out`` reduced in place. With ``root``, a reduce: only the root reduces (in
        one shot); the others lend their data."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        buf, op_code = call.out, call.op_code
        itemsize, code, count = call.dtype.itemsize, call.dtype.code, buf.numel
        keeps = root is None or rank == root  # this rank ends with the reduction
        per_step = self.slot_bytes // itemsize

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
        return self.run(call, stream, seconds, _steps(count, per_step), step,
                        self._scaled(call))

    def _reduce(self, call, stream, seconds):
        return self._all_reduce(call, True, stream, seconds, call.root)

    def _reduce_scatter(self, call, stream, seconds):
        """Step i: rank r copies piece i of each of its blocks into its slot, then reduces
        piece i of block r from every slot."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        out, inp, op_code = call.out, call.inp, call.op_code
        itemsize, code, m = call.dtype.itemsize, call.dtype.code, out.numel
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
        return self.run(call, stream, seconds, _steps(m, per_step), step, self._scaled(call))

    def _all_gather(self, call, stream, seconds):
        """Step i: every rank copies piece i of its input into its slot, then every slot's
        piece into its block of the output."""
        rt, device, itemsize = self.rt, self.device, call.dtype.itemsize
        out, inp = call.out, call.inp
        m = inp.numel
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
        return self.run(call, stream, seconds, _steps(m, per_step), step)

    def _broadcast(self, call, stream, seconds):
        rt, device, itemsize = self.rt, self.device, call.dtype.itemsize
        buf, root = call.out, call.root
        count, at_root = buf.numel, self.rank == root
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
        return self.run(call, stream, seconds, _steps(count, per_step), step)

    def _all_to_all(self, call, stream, seconds):
        """Rank r's part j of the input (in_splits[j] elements) into rank j's output, at its
        part r. Through the slots, on the host: step i has every rank copy piece i of its
        part for rank j into region j of its slot, and after a meeting, piece i of region
        r of every rank's slot into its output; the two slots take turns, so that one
        meeting per step suffices. Our own part goes straight from input to output."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, side, out, inp = call.dtype.itemsize, self.side, call.out, call.inp
        in_splits, out_splits = call.splits
        send, recv = _starts(in_splits), _starts(out_splits)
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

        def work(group):
            nsteps = _steps(max(group.allgather(max(in_splits))), per)
            fill(0)
            for i in range(nsteps):
                self._drain(call, seconds)  # my fill of step i and gather of step i - 1 are
                self.host.barrier()  # done, and every rank's: slot i % 2 full, the other free
                gather(i)
                if i + 1 < nsteps:
                    fill(i + 1)
        return self._on_host(call, stream, seconds, work)

    def _zero_copy(self, call, placed, stream, seconds):
        """A call on registered memory (``placed``: where my input lies in which), on the
        host: rank r reads its peers' inputs in place and writes its own output."""
        rt, device, size, rank, side = self.rt, self.device, self.size, self.rank, self.side
        out, itemsize, code, op = call.out, call.dtype.itemsize, call.dtype.code, call.op_code

        def enqueue(ptrs, group):
            if call.collective == "all_reduce":  # part r of every buffer is rank r's alone
                a, b = _parts(out.numel, size, itemsize)[rank]
                part = [p + a * itemsize for p in ptrs]
                if b > a:
                    rt.reduce_n(part, part, b - a, code, op, device, side)
            elif call.collective == "reduce" and rank == call.root:
                rt.reduce_n([out.ptr], ptrs, out.numel, code, op, device, side)
            elif call.collective == "reduce_scatter":
                m = out.numel
                rt.reduce_n([out.ptr], [p + rank * m * itemsize for p in ptrs], m, code, op,
                            device, side)
            elif call.collective == "all_gather":
                nbytes = call.inp.nbytes
                for r, p in enumerate(ptrs):
                    if out.ptr + r * nbytes != p:  # in place, my input is my output's block
                        rt.copy_async(out.ptr + r * nbytes, p, nbytes, device, side)
            elif call.collective == "broadcast" and rank != call.root:
                rt.copy_async(out.ptr, ptrs[call.root], out.nbytes, device, side)
            elif call.collective == "all_to_all":
                in_splits, out_splits = call.splits
                inputs, recv = group.allgather(in_splits), _starts(out_splits)
                for j, p in enumerate(ptrs):  # my part lies in input j after its parts before
                    if out_splits[j]:
                        rt.copy_async(out.ptr + recv[j] * itemsize,
                                      p + sum(inputs[j][:rank]) * itemsize,
                                      out_splits[j] * itemsize, device, side)

        def work(group):
            enqueue(self.registered.placed(group, *placed), group)
        return self._on_host(call, stream, seconds, work, self._scaled(call))

    def _scaled(self, call):
        """The phase after a call that averages on this rank: its output scaled."""
        if not call.scale:
            return None
        out = call.out
        return lambda st: self.rt.scale(out.ptr, call.scale, out.numel, call.dtype.code,
                                        self.device, st)

    def _on_host(self, call, stream, seconds, work, after=None):
        """A call of one step whose ``work(group)`` the host enqueues on our stream between
        its meetings; the caller's stream waits for the second, after that work."""
        def between(group):
            work(group)
            self._drain(call, seconds)
        nothing = lambda st: None  # noqa: E731
        return self.run(call, stream, seconds, 1, lambda i, mine, slots: [nothing, nothing],
                        after, between)

    def _drain(self, call, seconds) -> None:
        """Wait until our stream has done what it holds."""
        drained = self.rt.Event(self.device)
        drained.record(self.side)
        wait_event(drained, seconds, f"{call.collective} (ipc)")

    def run(self, call, stream: int, seconds: float, nsteps: int, step, after=None,
            between=None):
        """Enqueue ``nsteps`` steps (``step(i, my slot, every slot)`` gives step i's phases,
        functions of the stream), then ``after``; returns what ``issue`` does.
        ``between(group)``: host work of a one-step call between its two meetings."""
        rt, device, host = self.rt, self.device, self.host
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
        what = f"{call.collective} (ipc)"

        def meet(desc):
            if host.timeout != seconds:
                host.set_timeout(seconds)
            for i, events in enumerate(meetings):
                s = first + i
                for k, event in enumerate(events):
                    wait_event(event, seconds, what)
                    if i == 0 and k == 0:
                        host.agree(desc, call.split_bytes(), call.dtype.itemsize)
                    else:
                        host.barrier()
                    if k == 0:  # every rank is past step s - 1: its slot may be refilled
                        rt.store_counter(self.free, s)
                        if between is not None:  # host work, then the ranks meet again
                            between(host.world)
                            host.barrier()
                    rt.store_counter(self.go[k], s + 1)

        def release():  # after a failure: no stream may wait forever
            for counter in (self.free, *self.go):
                rt.store_counter(counter, first + nsteps)
        return meet, release, done


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

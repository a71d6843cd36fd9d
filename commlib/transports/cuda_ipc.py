"""cuda_ipc: the collectives among the GPU ranks of one host through CUDA IPC: kernels and
copies read the peers' device memory directly. Ranks may share a GPU (NCCL refuses that;
it is how one-GPU machines test this). One transport per device, beside the communicator's
shm transport (the *host*), which sets it up; its algorithms are registered in
commlib/algorithms/ipc.py.

Vocabulary:
  workspace  device memory of each rank, two *slots* of ``slot_bytes``, which every peer
             maps once per communicator (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
  step       one slot-sized chunk of a call; steps are numbered across the communicator's
             calls, and step s uses slot s % 2.
  phase      what a step does on the stream before the ranks first meet (fill my slot),
             between meetings, and after the last (read the peers' slots).
  meeting    every rank's stream has finished the phase before: the stream marks its
             arrival in pinned memory (cuStreamWriteValue32). Where *streams meet* (the
             default), the arrivals lie in a page every rank maps and registers, and each
             stream waits for its peers' arrivals itself (cuStreamWaitValue32): no host is
             in the step loop. A call's first meeting, which checks every rank's row, and
             every meeting under COMMLIB_GPU_MEET=proxy go through the GPU proxy: it sees
             the arrival, meets the peers' proxies, and raises a counter that lets the
             streams go on.
  proxy      a C++ thread per communicator and device (csrc/gpu_proxy.h) that serves the
             meetings without the GIL and without CUDA, and watches those the streams hold
             by themselves for failures and timeouts: no Python thread, and no thread
             blocked in the driver, can stall a call. A call hands it its *plan* (steps,
             meetings per step, descriptor, timeout) before enqueuing anything.
  counters   words of pinned host memory the proxy raises and the streams wait for
             (cuStreamWaitValue32): ``go`` (one per meeting of a step: steps allowed past
             it) and ``free`` (steps every rank is done with, so that their slot may be
             written again; a step's first meeting frees the step before it). ``arrive``:
             the words the streams write. Where streams meet, a step's slot is free once
             every peer's stream has arrived at the first meeting of the step after it.
  one-shot   all_reduce where every rank reduces the whole chunk from every slot; two-shot:
             rank r reduces part r, and every rank copies the others after a second
             meeting (commlib/algorithms/ipc.py chooses).
  row        what each rank tells the others at a call's first meeting: its descriptor,
             all_to_all's splits, and where its registered input lies; the proxies check
             the rows against each other (a mismatch fails the call on every rank).
  exchanged  a call whose steps depend on the peers' rows (all_to_all's largest split, the
             registered buffers' places): its first meeting is the caller's, before it
             enqueues anything, and the caller waits for it.
  zero-copy  a call whose input lies in registered memory (Communicator.register) at every
             rank: each rank reads the peers' inputs where they lie, with no slot between.
  call order the calls of a communicator share the slots and counters, so they run in call
             order on the GPU too: a call on another stream than the last waits for it.

Synchronisation goes through the host, not kernels spinning on flags: ranks that share a
GPU take turns on it, so a kernel spinning on a peer's flag would wait out its time slice.
The caller enqueues everything; the communicator's engine thread only waits for the plan
to end (without the GIL) to complete the call's Work and record it.
"""
from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass

from .. import _C, settings
from ..cuda import MAX_POINTERS
from ..cuda.registered import Registrations
from ..errors import CollectiveMismatchError, CommError, CommTimeoutError
from .base import Transport, Where

MAX_RANKS = MAX_POINTERS  # a rank's reduce kernel reads (and writes) every rank's memory
ALIGN = 256
WORDS = ("go0", "go1", "free", "arrive0", "arrive1")  # the proxy's pinned words, a line each
ROW_WORDS = _C.GPU_PROXY_ROW_WORDS
_ERRORS = {_C.GPU_PROXY_FAILURES["mismatched"]: CollectiveMismatchError,
           _C.GPU_PROXY_FAILURES["timed_out"]: CommTimeoutError}


class CudaIpc(Transport):
    """A communicator's workspaces and counters on one device, and the collectives over
    them; set up collectively on the communicator's engine thread."""

    name = "cuda_ipc"
    offers = frozenset({"cuda_ipc"})

    def __init__(self, host, device: int, runtime):
        super().__init__(host.world)
        self.host, self.rt, self.device = host, runtime, device
        self.slot_bytes = settings.get("COMMLIB_CUDA_IPC_SLOT_BYTES")
        self.slot_bytes = max(ALIGN, self.slot_bytes // ALIGN * ALIGN)
        self.workspace = self.words = self.proxy = self.page = None
        self.peers: list[int] = []
        # who holds the meetings after a call's first
        self.streams_meet = settings.get("COMMLIB_GPU_MEET") == "streams"
        self.arrivals: list[tuple[int, int]] = []  # where streams meet: each rank's words
        # at 3+ ranks, chunks up to this reduce in one shot
        self.one_shot_bytes = settings.get("COMMLIB_CUDA_IPC_ONE_SHOT_BYTES")
        self.where = Where(self.name, slot_bytes=self.slot_bytes,
                           one_shot_bytes=self.one_shot_bytes)
        self.step = 0  # steps issued so far
        self.tail = None  # (event after the last call's work, its stream)
        self.registered = Registrations(runtime, device, self.rank)
        self.usable = False
        self.problem = None  # why not, when set-up failed on some rank

    @staticmethod
    def suits(host) -> bool:
        """Whether ``host``'s GPU calls may come here: shm, 2 to 16 ranks, COMMLIB_CUDA_IPC."""
        return ("shm" in host.offers and 2 <= host.size <= MAX_RANKS
                and settings.get("COMMLIB_CUDA_IPC"))

    # the Transport interface's agreement and barrier: the host's (calls through IPC meet
    # in the proxy)
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
        if problem is None:
            self.words = rt.host_alloc(len(WORDS) * 64)
            for k in range(len(WORDS)):
                rt.store_counter(self.words + 64 * k, 0)
        problems = [p for p in group.allgather(problem) if p]
        if not problems:  # (collective: every rank or none)
            problems = [p for p in group.allgather(self._start_proxy(group)) if p]
        if problems:
            self.close()
            self.problem = problems[0]
            return
        rt.load_kernels(device)  # before any wait: a first launch behind one may hang
        self.usable = True

    def _start_proxy(self, group) -> str | None:
        """Every rank's proxy over one channel, which rank 0 makes and the others open; rank
        0 unlinks it once every rank has it, so that a crash leaves nothing in /dev/shm.
        Returns the problem, if any."""
        spin = 0 if group.cores_each() < 1 else settings.get("COMMLIB_GPU_PROXY_SPIN")
        if self.streams_meet:  # every rank, or the proxies hold every meeting
            self.streams_meet = all(group.allgather(self._can_register()))
        words = [self.word(name) for name in WORDS]
        problem = None
        try:
            if group.rank == 0:
                self.proxy = _C.GpuProxy(0, group.size, "", True, words, spin, self.streams_meet)
        except RuntimeError as e:
            problem = f"rank 0 cannot make its GPU proxy's channel: {e}"
        channel = group.allgather(self.proxy.channel if self.proxy else None)[0]
        try:
            if group.rank != 0 and channel is not None:
                self.proxy = _C.GpuProxy(group.rank, group.size, channel, False, words, spin,
                                         self.streams_meet)
        except RuntimeError as e:
            problem = f"rank {group.rank} cannot open the GPU proxy's channel: {e}"
        group.allgather(None)  # every rank has opened it (or given up)
        if self.proxy is not None and group.rank == 0:
            self.proxy.unlink()
        if self.proxy is not None and self.streams_meet:
            try:  # the streams read and write the page's words: CUDA must map it
                self.rt.host_register(*self.proxy.page)
                self.page = self.proxy.page[0]
            except RuntimeError as e:
                problem = (f"rank {group.rank} cannot register the GPU proxy's page with CUDA "
                           f"({e}); COMMLIB_GPU_MEET=proxy does without")
            self.arrivals = [(self.proxy.arrival(r, 0), self.proxy.arrival(r, 1))
                             for r in range(group.size)]
        return problem or (None if channel else "no GPU proxy channel")

    def _can_register(self) -> bool:
        """Whether CUDA maps shared memory of ours into the device here, as the streams
        need where they meet by themselves (the proxy's page): tried on a page of our own."""
        page = mmap.mmap(-1, mmap.PAGESIZE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        try:
            self.rt.host_register(address, mmap.PAGESIZE)
            self.rt.host_unregister(address)
            return True
        except RuntimeError:
            return False
        finally:
            page.close()

    def word(self, name: str) -> int:

        """The address of one of the proxy's pinned words (WORDS)."""
        return self.words + 64 * WORDS.index(name)

    @property
    def go(self) -> tuple[int, int]:
        return self.word("go0"), self.word("go1")

    @property
    def free(self) -> int:
        return self.word("free")

    @property
    def arrive(self) -> tuple[int, int]:
        """The words this rank's stream writes at a step's meetings."""
        if self.streams_meet:
            return self.arrivals[self.rank]
        return self.word("arrive0"), self.word("arrive1")

    def _wait_for_peers(self, stream: int, k: int, value: int) -> None:
        """The stream waits until every peer's stream has reached meeting ``k`` of step
        ``value - 1`` (streams meet)."""
        for r, words in enumerate(self.arrivals):
            if r != self.rank:
                self.rt.wait_value(stream, self.device, words[k], value)

    def take_failure(self) -> CommError | None:
        """The proxy's first failure as the error to raise, once (None: none, or taken)."""
        if self.proxy is None:
            return None
        kind, text = self.proxy.take_failure()
        return _ERRORS.get(kind, CommError)(text) if kind else None

    def heartbeat(self) -> dict:
        """What the proxy is doing (a hang's report): plan, step, meeting, counters."""
        return self.proxy.heartbeat() if self.proxy is not None else {}

    def close(self) -> None:
        rt, device = self.rt, self.device
        if self.proxy is not None:
            self.proxy.close()  # (its thread gone, nothing touches the words)
            if self.page is not None:
                rt.host_unregister(self.page)
                self.page = None
            if self.streams_meet:
                self.proxy.unregistered()
            self.proxy = None

        self.registered.close()
        for ptr in self.peers:
            if ptr != self.workspace:
                rt.ipc_close(ptr, device)
        self.peers = []
        if self.workspace is not None:
            rt.device_free(self.workspace, device)
            self.workspace = None
        if self.words is not None:
            rt.host_free(self.words)
            self.words = None
        self.usable = False

    # The collectives: each cuts its call into steps and says what a step does in each
    # phase (before the first meeting of the ranks, after it, after the second); or, with
    # its input registered at every rank, reads the peers' inputs in one step.
    def issue(self, call, algorithm: str, stream: int, seconds: float) -> "OnGpu":
        """``call`` by ``algorithm`` (commlib/algorithms/ipc.py) on ``stream``: its plan is
        with the proxy when this returns (an exchanged call's first meeting over), its work
        to enqueue (``OnGpu.enqueue``)."""
        if algorithm == "zerocopy":
            buf = call.inp if call.inp is not None else call.out
            return self._zero_copy(call, self.registered.of(buf), stream, seconds)
        return getattr(self, "_" + call.collective)(call, algorithm, stream, seconds)

    def _all_reduce(self, call, algorithm, stream, seconds, root=None):
        """``call.out`` reduced in place. With ``root``, a reduce: only the root reduces (in
        one shot); the others lend their data."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        buf, op_code = call.out, call.op_code
        itemsize, code, count = call.dtype.itemsize, call.dtype.code, buf.numel
        keeps = root is None or rank == root  # this rank ends with the reduction
        one_shot = root is not None or algorithm == "oneshot"
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
        plan = self.hand_over(call, algorithm, seconds, _steps(count, per_step),
                              meetings=1 if one_shot else 2)
        return self.run(plan, stream, step, self._scaled(call))

    def _reduce(self, call, algorithm, stream, seconds):
        return self._all_reduce(call, algorithm, stream, seconds, call.root)

    def _reduce_scatter(self, call, algorithm, stream, seconds):
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
        plan = self.hand_over(call, algorithm, seconds, _steps(m, per_step))
        return self.run(plan, stream, step, self._scaled(call))

    def _all_gather(self, call, algorithm, stream, seconds):
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
        return self.run(self.hand_over(call, algorithm, seconds, _steps(m, per_step)), stream,
                        step)

    def _broadcast(self, call, algorithm, stream, seconds):
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
        return self.run(self.hand_over(call, algorithm, seconds, _steps(count, per_step)),
                        stream, step)

    def _all_to_all(self, call, algorithm, stream, seconds):
        """Rank r's part j of the input (in_splits[j] elements) into rank j's output, at its
        part r. Step i has every rank copy piece i of its part for rank j into region j of
        its slot, and after a meeting, piece i of region r of every rank's slot into its
        output. The steps depend on every rank's splits: the call is exchanged (the proxy
        counts the steps the largest part of any rank takes). Our own part goes straight
        from input to output."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, out, inp = call.dtype.itemsize, call.out, call.inp
        in_splits, out_splits = call.splits
        send, recv = _starts(in_splits), _starts(out_splits)
        per = max(1, self.slot_bytes // size // itemsize)  # elements per region and step
        plan = self.hand_over(call, algorithm, seconds, exchanged=True, step_bytes=per * itemsize)

        def step(i, mine, slots):
            def fill(st):
                for j in range(size):
                    lo, k = _piece(i, per, in_splits[j])
                    if k and j != rank:
                        rt.copy_async(mine + j * per * itemsize,
                                      inp.ptr + (send[j] + lo) * itemsize, k * itemsize,
                                      device, st)

            def gather(st):
                for j in range(size):
                    lo, k = _piece(i, per, out_splits[j])
                    if k:
                        source = (inp.ptr + (send[rank] + lo) * itemsize if j == rank
                                  else slots[j] + rank * per * itemsize)
                        rt.copy_async(out.ptr + (recv[j] + lo) * itemsize, source,
                                      k * itemsize, device, st)
            return [fill, gather]
        return self.run(plan, stream, step)

    def _zero_copy(self, call, placed, stream, seconds):
        """A call on registered memory (``placed``: where my input lies in which), in one
        step: once every rank's stream is there, rank r reads its peers' inputs in place
        and writes its own output; the ranks meet again before their streams go on. The
        ranks exchange where their inputs lie (and all_to_all's splits) first."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize = call.dtype.itemsize
        registration, offset = placed
        plan = self.hand_over(call, "zerocopy", seconds, 1, meetings=2, exchanged=True,
                              extra=(registration.index, offset))
        if plan.rows is None:
            return self.run(plan, stream, None)
        ptrs = [self.registered.by_index[row[-2]].peers[r] + row[-1]
                for r, row in enumerate(plan.rows)]
        inputs = [[b // itemsize for b in row[8:8 + size]] for row in plan.rows]

        reads = InPlace(rt, device, size, rank, call, ptrs, inputs)
        work = lambda st: ZERO_COPY[call.collective](reads, st)  # noqa: E731
        nothing = lambda st: None  # noqa: E731
        return self.run(plan, stream, lambda i, mine, slots: [nothing, work, nothing],
                        self._scaled(call))

    def _scaled(self, call):
        """The phase after a call that averages on this rank: its output scaled."""
        if not call.scale:
            return None
        out = call.out
        return lambda st: self.rt.scale(out.ptr, call.scale, out.numel, call.dtype.code,
                                        self.device, st)

    def hand_over(self, call, algorithm: str, seconds: float, steps: int = 0,
                  meetings: int = 1, exchanged: bool = False, extra=(0, 0),
                  step_bytes: int = 0) -> "Plan":
        """The call's plan, handed to the proxy before anything is enqueued: ``steps``
        steps of ``meetings`` meetings each, from the next step of the communicator on. An
        ``exchanged`` plan's first meeting is now: this waits for it, and the plan holds
        every rank's row (None if it failed: the proxy has its error); with ``step_bytes``
        its steps come from the splits of every rank (all_to_all)."""
        row = call.descriptor(algorithm)
        splits = call.split_bytes()
        if splits is not None:
            row += [*splits[0], *splits[1]]
        row += [0] * (ROW_WORDS - 2 - len(row)) + list(extra)
        first = self.step
        plan = Plan(self.proxy.submit(first, steps, meetings, row, call.dtype.itemsize,
                                      splits is not None, exchanged, seconds or 0.0, step_bytes),
                    first, steps, exchanged)
        if exchanged:
            try:
                plan.rows = self.proxy.rows(plan.id)
            except CommError:  # raised by the call's Work and the next call
                plan.steps = 0
            else:
                if step_bytes:
                    largest = max(max(row[8:8 + self.size]) for row in plan.rows)
                    plan.steps = max(1, -(-largest // step_bytes))
        self.step += plan.steps
        return plan

    def run(self, plan: "Plan", stream: int, step, after=None) -> "OnGpu":
        """``plan``'s steps (``step(i, my slot, every slot)`` gives step i's phases,
        functions of the stream), then ``after``, as an OnGpu to enqueue."""
        rt, device, proxy, streams_meet = self.rt, self.device, self.proxy, self.streams_meet
        tail = self.tail
        done = rt.Event(device)
        self.tail = (done, stream)

        def enqueue():
            try:
                if tail is not None and tail[1] != stream:
                    # the calls share the slots and counters, so they run in call order on
                    # the GPU too: a call on another stream would otherwise refill a slot
                    # still being read
                    tail[0].wait(stream)
                for i in range(plan.steps):
                    s = plan.first + i
                    offset = (s % 2) * self.slot_bytes
                    phases = step(i, self.workspace + offset, [p + offset for p in self.peers])
                    if s >= 2 and streams_meet:  # every peer is past step s - 2, my slot's
                        self._wait_for_peers(stream, 0, s)
                    elif s >= 2:
                        rt.wait_value(stream, device, self.free, s - 1)
                    for k, phase in enumerate(phases):
                        if k:  # the ranks meet: the stream says it got here, and waits for
                            rt.write_value(stream, device, self.arrive[k - 1], s + 1)
                            if streams_meet and (k > 1 or i > 0 or plan.exchanged):
                                self._wait_for_peers(stream, k - 1, s + 1)  # the peers
                            else:  # the proxies (the rows are checked at the first)
                                rt.wait_value(stream, device, self.go[k - 1], s + 1)
                        phase(stream)
                if after is not None and plan.steps:
                    after(stream)
                done.record(stream)
            except BaseException as e:
                proxy.fail(f"rank {self.rank} could not enqueue its part: {e}")  # peers too
                raise
        return OnGpu(enqueue, lambda: proxy.wait(plan.id), done)


class Plan:
    """A call as handed to the proxy: its id there, its steps [first, first + steps) and
    (exchanged) every rank's row."""

    __slots__ = ("id", "first", "steps", "exchanged", "rows")

    def __init__(self, id: int, first: int, steps: int, exchanged: bool):
        self.id, self.first, self.steps, self.exchanged = id, first, steps, exchanged
        self.rows = None


class OnGpu:
    """A call through CUDA IPC, handed to the proxy. The caller runs ``enqueue()``, which
    puts its steps on the stream; ``wait()`` (the engine's) returns once the proxy is done
    with it ((started, ended), time.monotonic's), or raises its error; ``done``: the event
    after the call's work, recorded by ``enqueue``."""

    def __init__(self, enqueue, wait, done):
        self.enqueue, self.wait, self.done = enqueue, wait, done


@dataclass(frozen=True)
class InPlace:
    """What a zero-copy call's one step reads: every rank's input where this rank maps it
    (``ptrs``) and, for all_to_all, each rank's input parts in elements (``inputs``)."""
    rt: object
    device: int
    size: int
    rank: int
    call: object
    ptrs: list
    inputs: list

    def reduce_n(self, targets, sources, count, st) -> None:
        c = self.call
        self.rt.reduce_n(targets, sources, count, c.dtype.code, c.op_code, self.device, st)

    def copy(self, dst, src, nbytes, st) -> None:
        self.rt.copy_async(dst, src, nbytes, self.device, st)


def _all_reduce_in_place(z: InPlace, st) -> None:
    """Part r of every buffer is rank r's alone: it reduces that part into all of them."""
    itemsize = z.call.dtype.itemsize
    a, b = _parts(z.call.out.numel, z.size, itemsize)[z.rank]
    part = [p + a * itemsize for p in z.ptrs]
    if b > a:
        z.reduce_n(part, part, b - a, st)


def _reduce_in_place(z: InPlace, st) -> None:
    if z.rank == z.call.root:
        z.reduce_n([z.call.out.ptr], z.ptrs, z.call.out.numel, st)


def _reduce_scatter_in_place(z: InPlace, st) -> None:
    out, itemsize = z.call.out, z.call.dtype.itemsize
    z.reduce_n([out.ptr], [p + z.rank * out.numel * itemsize for p in z.ptrs], out.numel, st)


def _all_gather_in_place(z: InPlace, st) -> None:
    out, nbytes = z.call.out, z.call.inp.nbytes
    for r, p in enumerate(z.ptrs):
        if out.ptr + r * nbytes != p:  # in place, my input is my output's block
            z.copy(out.ptr + r * nbytes, p, nbytes, st)


def _broadcast_in_place(z: InPlace, st) -> None:
    if z.rank != z.call.root:
        z.copy(z.call.out.ptr, z.ptrs[z.call.root], z.call.out.nbytes, st)


def _all_to_all_in_place(z: InPlace, st) -> None:
    out, itemsize = z.call.out, z.call.dtype.itemsize
    out_splits, recv = z.call.splits[1], _starts(z.call.splits[1])
    for j, p in enumerate(z.ptrs):  # my part lies in input j after its parts before
        if out_splits[j]:
            z.copy(out.ptr + recv[j] * itemsize, p + sum(z.inputs[j][:z.rank]) * itemsize,
                   out_splits[j] * itemsize, st)


# each collective's zero-copy step (CudaIpc._zero_copy)
ZERO_COPY = {"all_reduce": _all_reduce_in_place, "reduce": _reduce_in_place,
             "reduce_scatter": _reduce_scatter_in_place, "all_gather": _all_gather_in_place,
             "broadcast": _broadcast_in_place, "all_to_all": _all_to_all_in_place}


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

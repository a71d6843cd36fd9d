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
  exchange   what a call's steps depend on from the peers (all_to_all's splits, the
             registered buffers' places): the ranks agree on the call and allgather it
             on the engine before the caller enqueues the steps.
  zero-copy  a call whose input lies in registered memory (Communicator.register) at every
             rank: each rank reads the peers' inputs where they lie, with no slot between.
  call order the calls of a communicator share the slots and counters, so they run in call
             order on the GPU too: a call on another stream than the last waits for it.

Synchronisation goes through the host, as for the staged calls: ranks that share a GPU take
turns on it, so a kernel spinning on a peer's flag would wait out its time slice.
The engine thread makes no CUDA call but querying events: on an H200 a cudaMemcpyAsync
there blocked while the caller sat in torch's copy to pageable host memory behind the call
(`.cpu()`), whose stream waited for that engine. The caller enqueues everything.
"""
from __future__ import annotations

import os
import queue

from ..algorithms import Where
from ..cuda import MAX_POINTERS
from ..cuda.registered import Registrations
from ..cuda.staging import wait_event
from ..errors import CommError, CommTimeoutError
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
        rt.load_kernels(device)  # before any wait: a first launch behind one may hang
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
    def issue(self, call, algorithm: str, stream: int, seconds: float, exchange) -> OnGpu:
        """``call`` by ``algorithm`` (commlib/algorithms/ipc.py) on ``stream``, to enqueue.
        ``exchange(fn)``: the ranks agree on the call and return ``fn(group)`` (a host
        collective, run by the engine), for calls whose steps depend on the peers' values."""
        if algorithm == "zerocopy":
            buf = call.inp if call.inp is not None else call.out
            return self._zero_copy(call, self.registered.of(buf), stream, seconds, exchange)
        if call.collective == "all_reduce":
            return self._all_reduce(call, algorithm == "oneshot", stream, seconds)
        if call.collective == "all_to_all":
            return self._all_to_all(call, stream, seconds, exchange)
        return getattr(self, "_" + call.collective)(call, stream, seconds)

    def failed(self, error: BaseException, stream: int) -> OnGpu:
        """A call whose exchange failed: nothing on the stream; its meetings raise ``error``."""
        done = self.rt.Event(self.device)

        def meet(desc):
            raise error
        return OnGpu(lambda: done.record(stream), meet, lambda: None, done)

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

    def _all_to_all(self, call, stream, seconds, exchange):
        """Rank r's part j of the input (in_splits[j] elements) into rank j's output, at its
        part r. Step i has every rank copy piece i of its part for rank j into region j of
        its slot, and after a meeting, piece i of region r of every rank's slot into its
        output. The steps depend on every rank's splits: the ranks exchange their largest
        first. Our own part goes straight from input to output."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        itemsize, out, inp = call.dtype.itemsize, call.out, call.inp
        in_splits, out_splits = call.splits
        send, recv = _starts(in_splits), _starts(out_splits)
        per = max(1, self.slot_bytes // size // itemsize)  # elements per region and step
        largest = max(exchange(lambda group: group.allgather(max(in_splits))))

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
        return self.run(call, stream, seconds, _steps(largest, per), step, agreed=True)

    def _zero_copy(self, call, placed, stream, seconds, exchange):
        """A call on registered memory (``placed``: where my input lies in which), in one
        step: once every rank's stream is there, rank r reads its peers' inputs in place
        and writes its own output; the ranks meet again before their streams go on."""
        rt, device, size, rank = self.rt, self.device, self.size, self.rank
        out, itemsize, code, op = call.out, call.dtype.itemsize, call.dtype.code, call.op_code
        all_to_all = call.collective == "all_to_all"
        ptrs, inputs = exchange(lambda group: (
            self.registered.placed(group, *placed),
            group.allgather(call.splits[0]) if all_to_all else None))

        def work(st):
            if call.collective == "all_reduce":  # part r of every buffer is rank r's alone
                a, b = _parts(out.numel, size, itemsize)[rank]
                part = [p + a * itemsize for p in ptrs]
                if b > a:
                    rt.reduce_n(part, part, b - a, code, op, device, st)
            elif call.collective == "reduce" and rank == call.root:
                rt.reduce_n([out.ptr], ptrs, out.numel, code, op, device, st)
            elif call.collective == "reduce_scatter":
                m = out.numel
                rt.reduce_n([out.ptr], [p + rank * m * itemsize for p in ptrs], m, code, op,
                            device, st)
            elif call.collective == "all_gather":
                nbytes = call.inp.nbytes
                for r, p in enumerate(ptrs):
                    if out.ptr + r * nbytes != p:  # in place, my input is my output's block
                        rt.copy_async(out.ptr + r * nbytes, p, nbytes, device, st)
            elif call.collective == "broadcast" and rank != call.root:
                rt.copy_async(out.ptr, ptrs[call.root], out.nbytes, device, st)
            elif all_to_all:
                out_splits, recv = call.splits[1], _starts(call.splits[1])
                for j, p in enumerate(ptrs):  # my part lies in input j after its parts before
                    if out_splits[j]:
                        rt.copy_async(out.ptr + recv[j] * itemsize,
                                      p + sum(inputs[j][:rank]) * itemsize,
                                      out_splits[j] * itemsize, device, st)
        nothing = lambda st: None  # noqa: E731
        return self.run(call, stream, seconds, 1, lambda i, mine, slots: [nothing, work, nothing],
                        self._scaled(call), agreed=True)

    def _scaled(self, call):
        """The phase after a call that averages on this rank: its output scaled."""
        if not call.scale:
            return None
        out = call.out
        return lambda st: self.rt.scale(out.ptr, call.scale, out.numel, call.dtype.code,
                                        self.device, st)

    def run(self, call, stream: int, seconds: float, nsteps: int, step, after=None,
            agreed: bool = False) -> "OnGpu":
        """``nsteps`` steps (``step(i, my slot, every slot)`` gives step i's phases,
        functions of the stream), then ``after``, as an OnGpu. ``agreed``: the ranks agreed
        on the call already (in an exchange), so its first meeting is a barrier."""
        rt, device, host = self.rt, self.device, self.host
        tail, first = self.tail, self.step
        self.step += nsteps
        done = rt.Event(device)
        self.tail = (done, stream)
        steps: queue.SimpleQueue = queue.SimpleQueue()  # per step, its meetings' events
        what = f"{call.collective} (ipc)"

        def enqueue():
            try:
                if tail is not None and tail[1] != stream:
                    # the calls share the slots and counters, so they run in call order on
                    # the GPU too: a call on another stream would otherwise refill a slot
                    # still being read
                    tail[0].wait(stream)
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
                    steps.put(events)
                if after is not None:
                    after(stream)
                done.record(stream)
            except BaseException:
                steps.put(None)
                release()
                raise

        def meet(desc):
            if host.timeout != seconds:
                host.set_timeout(seconds)
            for i in range(nsteps):
                try:
                    events = steps.get(timeout=seconds)
                except queue.Empty:
                    raise CommTimeoutError(f"{what}: its step {i} was not enqueued within "
                                           f"{seconds:g} s") from None
                if events is None:
                    raise CommError(f"{what}: enqueuing it on the stream failed")
                s = first + i
                for k, event in enumerate(events):
                    wait_event(event, seconds, what)
                    if i == 0 and k == 0 and not agreed:
                        host.agree(desc, call.split_bytes(), call.dtype.itemsize)
                    else:
                        host.barrier()
                    if k == 0:  # every rank is past step s - 1: its slot may be refilled
                        rt.store_counter(self.free, s)
                    rt.store_counter(self.go[k], s + 1)

        def release():  # after a failure: no stream may wait forever
            for counter in (self.free, *self.go):
                rt.store_counter(counter, first + nsteps)
        return OnGpu(enqueue, meet, release, done)


class OnGpu:
    """A call through CUDA IPC, issued. The caller runs ``enqueue()``, which puts its steps
    on the stream and hands each step's events to ``meet(desc)``, the engine's part, as it
    goes: the engine meets the first steps while later ones are enqueued, so a call of more
    steps than CUDA's launch queue holds goes on (the caller blocks in a launch until the
    stream drains). ``release()`` lets the streams go on after a failure; ``done``: the
    event after the call's work, recorded by ``enqueue``."""

    def __init__(self, enqueue, meet, release, done):
        self.enqueue, self.meet, self.release, self.done = enqueue, meet, release, done


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

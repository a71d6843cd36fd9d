"""Collectives and point-to-point messages on GPU arrays through pinned host memory,
enqueued on the caller's stream like NCCL's calls.

Vocabulary:
  twin    the pinned host copy of one device buffer of a call (a buffer that lies inside
          another, as in-place all_gather's input, is a part of that one's twin).
  block   the pinned memory of one call's twins, followed by its *flag*: a word the host
          sets to 1 when its part is done, and its *ready* word, which the stream sets to 1
          once the inputs are in the twins (the host reads it without a CUDA call). Blocks
          are reused once their call's *done* event has passed.
  stream  where a call is enqueued: the caller's current stream, or (async_op) the
          communicator's side stream for that device, made to wait for the current one.

A staged call enqueues, and returns:

    copy what it reads into the twins -> ready = 1 -> wait until flag == 1
    -> copy what it writes back from the twins -> record `done`

The communicator's progress engine waits for `ready` (reading the word: a CUDA call there
could wait behind the caller's synchronous copy, which waits for the engine), runs the call
on the twins with the CPU path (any algorithm, any transport: this is how GPU data crosses
hosts), then sets the flag, which lets the stream go on. The flag is set when the call
fails too: no stream may wait forever. The failure is raised by the call's Work, and by
the communicator's first staged call issued after the flag was set (a call without
async_op has nothing else to raise it from).

With a CUDA-aware MPI, a call that MPI's own collective runs is staged *in place*: its
twins are the device memory itself, and nothing is copied.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np

from ..buffers import Buffer
from ..collectives import of as collective_of
from ..errors import CommError, CommTimeoutError
from ..work import Work
from . import current_stream, streams

ALIGN = 64  # twins and the flag start on cache lines
FLAG_BYTES = ALIGN


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class Block:
    """Pinned memory for one call: ``size`` bytes of twins (``bytes``, a numpy view made
    once), then the flag."""

    __slots__ = ("ptr", "size", "bytes", "done", "abandoned")

    def __init__(self, ptr: int, size: int):
        self.ptr, self.size = ptr, size
        self.bytes = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
        self.done = None  # the event after the call's last copy back
        self.abandoned = False  # MPI may still write into it (a timed-out call)

    @property
    def flag(self) -> int:
        return self.ptr + self.size

    @property
    def ready(self) -> int:
        return self.ptr + self.size + 8


class HostPool:
    """Pinned blocks by power-of-two size, reused once their call is over on the device."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._free: dict[int, list[Block]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Block:
        size = 1 << max(12, (nbytes - 1).bit_length())
        with self._lock:
            blocks = self._free.setdefault(size, [])
            blocks[:] = [b for b in blocks if not b.abandoned]  # leaked on purpose
            for i, block in enumerate(blocks):
                if block.done is None or block.done.query():
                    del blocks[i]
                    break
            else:
                block = Block(self.runtime.host_alloc(size + FLAG_BYTES), size)
        self.runtime.store_counter(block.flag, 0)
        self.runtime.store_counter(block.ready, 0)
        return block

    def give(self, block: Block, done) -> None:
        block.done = done
        with self._lock:
            self._free.setdefault(block.size, []).append(block)

    def close(self) -> None:
        """Free every block (after its last use on the device has finished)."""
        with self._lock:
            blocks = [b for bs in self._free.values() for b in bs if not b.abandoned]
            self._free.clear()
        for block in blocks:
            if block.done is not None:
                block.done.synchronize()
            self.runtime.host_free(block.ptr)


class Staged:
    """One call's device buffers (by name), their twins, and what it reads and writes."""

    def __init__(self, pool: HostPool, bufs: dict, reads: list, writes: list,
                 twins: dict | None = None, scale: float | None = None):
        self.bufs = bufs
        self.reads, self.writes = reads, writes
        self.array = bufs["out"].device  # a cuda.DeviceArray: device, stream
        self.device = self.array.device
        self.scale = scale  # "out" scaled by it on the stream after the call (in place)
        self.call = None  # the call on the twins, where this stages a collective
        if twins is not None:  # the device memory itself, which a CUDA-aware MPI takes
            self.block, self.host = pool.take(0), twins
            return
        offsets: dict = {}
        self.block = block = pool.take(_twins_bytes(bufs, offsets))
        self.host = {name: Buffer(block, block.ptr + offsets[name], b.numel, b.dtype,
                                  block.bytes[offsets[name]:offsets[name] + b.nbytes])
                     for name, b in bufs.items()}


def _twins_bytes(bufs: dict, offsets: dict) -> int:
    """Where each buffer's twin lies in a block (into ``offsets``), and the block's size: the
    largest first, so that a buffer inside another becomes a part of its twin."""
    end = 0
    for name in sorted(bufs, key=lambda name: -bufs[name].nbytes):
        b = bufs[name]
        outer = next((o for o in offsets if bufs[o].ptr <= b.ptr
                      and b.ptr + b.nbytes <= bufs[o].ptr + bufs[o].nbytes), None)
        if outer is not None:
            offsets[name] = offsets[outer] + (b.ptr - bufs[outer].ptr)
        else:
            offsets[name], end = end, end + _round_up(b.nbytes)
    return end


def _reads_and_writes(call, rank: int) -> tuple[list, list]:
    """The buffers a call on GPU memory copies to the host before it runs (what it reads)
    and back after (what it writes)."""
    reads, writes = ["in" if call.inp is not None else "out"], ["out"]
    kind = collective_of(call.collective)
    if kind.from_root:
        return (reads, []) if rank == call.root else ([], writes)
    if kind.rooted and rank != call.root:  # (reduce) the others' t is unchanged
        return reads, []
    return reads, writes


class Staging:
    """A communicator's staged calls: its pinned pool and its side streams."""

    def __init__(self):
        self.runtime = streams()
        self.pool = HostPool(self.runtime)
        self._side: dict[int, int] = {}  # device -> side stream
        self._kept: list = []  # (event, user arrays the stream uses until it passes)
        self.failure: BaseException | None = None  # of a call nobody waits for

    def raise_failure(self) -> None:
        """Raise (once) the failure of a call nobody waited for."""
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise CommError(f"an earlier collective on GPU buffers failed, so its outputs "
                            f"hold garbage: {failure}") from failure

    def stage(self, call, rank: int) -> Staged:
        """``call`` on pinned twins of its device buffers (``staged.call``)."""
        staged = Staged(self.pool, call.bufs, *_reads_and_writes(call, rank))
        staged.call = call.on(staged.host["out"], staged.host.get("in"))
        return staged

    def stage_message(self, buf, sent: bool) -> Staged:
        """A send's (``sent``) or a receive's buffer on a pinned twin."""
        return Staged(self.pool, {"out": buf}, ["out"] if sent else [], [] if sent else ["out"])

    def in_place(self, call) -> Staged:
        """``call`` run by a CUDA-aware MPI on the device memory itself (``staged.call``):
        no copies; the stream waits for the flag, then scales "out" (avg: the host cannot
        touch device memory)."""
        views = {name: device_view(b) for name, b in call.bufs.items()}
        staged = Staged(self.pool, call.bufs, [], [], views, call.scale)
        staged.call = call.on(views["out"], views.get("in"))
        staged.call.scale = None
        return staged

    def stream_for(self, array, async_op: bool) -> int:
        """Where a call on device ``array`` (a cuda.DeviceArray) runs: the caller's stream;
        with async_op, the side stream, made to wait for what the caller's holds (so that
        the caller's stream never waits for this call unasked)."""
        if not async_op:
            return array.stream
        device = array.device
        if device not in self._side:
            self._side[device] = self.runtime.stream_create(device)
        caller = self.runtime.Event(device)
        caller.record(array.stream)
        caller.wait(self._side[device])
        return self._side[device]

    def copy_in(self, staged: Staged, stream: int) -> "Word":
        """Enqueue the copies of what the call reads; returns the word the stream sets
        after them."""
        rt = self.runtime
        for name in staged.reads:
            b = staged.bufs[name]
            rt.copy_async(staged.host[name].ptr, b.ptr, b.nbytes, staged.device, stream)
        rt.write_value(stream, staged.device, staged.block.ready, 1)
        return Word(staged.block.ready)

    def copy_out(self, staged: Staged, stream: int):
        """Enqueue the wait for the flag and the copies of what the call writes; the block
        goes back to the pool, reusable once the returned event has passed."""
        rt = self.runtime
        rt.load_kernels(staged.device)  # before any wait: a first launch behind one may hang
        rt.wait_value(stream, staged.device, staged.block.flag, 1)
        try:
            for name in staged.writes:
                b = staged.bufs[name]
                rt.copy_async(b.ptr, staged.host[name].ptr, b.nbytes, staged.device, stream)
            if staged.scale is not None:
                out = staged.bufs["out"]
                rt.scale(out.ptr, staged.scale, out.numel, out.dtype.code, staged.device,
                         stream)
        except BaseException:
            rt.store_counter(staged.block.flag, 1)  # the call never starts: let the stream go
            raise
        done = rt.Event(staged.device)
        done.record(stream)
        self.pool.give(staged.block, done)
        self.keep_until(done, [b.obj for b in staged.bufs.values()])
        return done

    def keep_until(self, done, arrays: list) -> None:
        """Keep the user's ``arrays`` alive until ``done`` has passed: the stream still
        writes into them after the call returns, and their memory must not be freed and
        handed out meanwhile (a framework's allocator may reuse it on another stream)."""
        self._kept = [k for k in self._kept if not k[0].query()]
        self._kept.append((done, arrays))

    def copy_to_host_now(self, staged: Staged, seconds: float, what: str) -> None:
        """Copy what the call reads to its twins once its stream gets there, and wait."""
        wait_event(self.copy_in(staged, staged.array.stream), seconds, what)

    # These two take a call's block, not the call: they run on the engine's or the
    # poller's thread, which must not hold the user's arrays (their last reference may go
    # there, and a framework may make a CUDA call when one is freed).
    def sent(self, block: Block, error: BaseException | None = None) -> None:
        """A send from the twins is over: the block may be reused (unless MPI still may
        read it, after a timeout)."""
        block.abandoned = isinstance(error, CommTimeoutError)
        self.pool.give(block, None)

    def host_part_over(self, block: Block, error: BaseException | None,
                       remember: bool = True) -> None:
        """Let the stream go on; first ``remember`` the error for the next call to raise
        (after a timeout, MPI may still write into the block: it is never reused)."""
        if remember:
            self.remember(error)
        block.abandoned = isinstance(error, CommTimeoutError)
        self.runtime.store_counter(block.flag, 1)

    def issue(self, engine, what: str, call, staged: Staged, async_op: bool, result,
              seconds: float):
        """Enqueue ``staged`` on its stream and queue ``call`` (the collective on the twins)
        on ``engine``; returns ``result``, or a StagedWork if ``async_op``. ``call(before)``
        calls ``before()`` first, within the call: the wait for the stream to copy the
        inputs in (a timeout there fails the call as a peer's absence does)."""
        stream = self.stream_for(staged.array, async_op)
        ready = self.copy_in(staged, stream)
        done = self.copy_out(staged, stream)
        block = staged.block

        def task():
            error = None
            try:
                call(lambda: wait_event(ready, seconds, what))
            except BaseException as e:
                error = e
                raise
            finally:
                self.host_part_over(block, error)

        return self.submit(engine, what, task, done, staged.array, async_op, result)

    def submit(self, engine, what: str, task, done, array, async_op: bool, result):
        """Queue a call's host part ``task`` on ``engine``; returns the call's result, or a
        StagedWork that follows ``done`` (its last event on the stream) if ``async_op``."""
        host_work = engine.run(what, task, async_op=True)
        return StagedWork(what, host_work, done, array, result, self) if async_op else result

    def remember(self, error: BaseException | None) -> None:
        """Keep the first failure of a call nobody may wait for, for the next call to raise."""
        if error is not None and self.failure is None:
            self.failure = error

    def close(self) -> None:
        self.pool.close()


def device_view(buf) -> Buffer:
    """``buf``'s device memory as MPI takes it (by address)."""
    from mpi4py import MPI
    return Buffer(buf.obj, buf.ptr, buf.numel, buf.dtype,
                  MPI.buffer.fromaddress(buf.ptr, buf.nbytes))


class Word:
    """A word of pinned memory that a stream sets to 1 once it gets there (write_value),
    asked like an event but read by the host, with no CUDA call."""

    __slots__ = ("address",)

    def __init__(self, address: int):
        self.address = address

    def query(self) -> bool:
        return ctypes.c_uint32.from_address(self.address).value == 1


def wait_event(event, seconds: float | None, what: str) -> None:
    """Poll ``event`` (or a Word) until it has passed; raise CommTimeoutError after
    ``seconds``."""
    start = time.monotonic()
    polls = 0
    while not event.query():
        polls += 1
        if polls > 1000:
            time.sleep(50e-6)  # a long kernel before the call: stop spinning
            if seconds and time.monotonic() - start > seconds:
                raise CommTimeoutError(f"{what}: the GPU work before it did not finish "
                                       f"within {seconds:g} s")
        else:
            os.sched_yield()


class StagedWork(Work):
    """A staged call's Work. Like NCCL's through torch: ``wait()`` makes the caller's
    current stream wait for the call and returns at once; ``synchronize()`` blocks the host
    until the results are in device memory. Both raise the call's error if it has failed
    (wait() only if the host part is over by then)."""

    def __init__(self, what: str, host_work: Work, done, array, result, staging):
        super().__init__(what)
        self._done_event, self._array, self._staging = done, array, staging
        def finished(work):
            self.source = work.source  # (a receive's)
            self._finish(result, work.exception())
        host_work.add_done_callback(finished)

    def wait(self, timeout: float | None = None) -> bool:
        self._raise_failure()
        self._done_event.wait(current_stream(self._array))
        return True

    def synchronize(self, timeout: float | None = None) -> bool:
        if not self._done.wait(timeout):
            raise CommTimeoutError(f"{self.what} did not complete within {timeout} s")
        self._raise_failure()
        wait_event(self._done_event, timeout, self.what)
        return True

    def _raise_failure(self) -> None:
        if self._exception is not None:
            if self._staging.failure is self._exception:  # raised here: not again
                self._staging.failure = None
            raise self._exception

    def is_completed(self) -> bool:
        return super().is_completed() and (self._exception is not None
                                           or self._done_event.query())

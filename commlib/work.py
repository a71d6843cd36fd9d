"""Asynchronous work: Work handles, and the two progress threads a communicator owns.

- ProgressEngine: a FIFO of collectives run by one background thread per communicator, so
  collectives on a communicator complete in issue order (like a CUDA stream) while
  different communicators progress independently. A blocking call runs inline on the
  caller's thread when the engine is idle (no thread hop for the common case); otherwise
  it queues behind the outstanding work and waits. A call its transport runs as a job of
  its own thread (the net transport's proxy) is handed to that thread at once where no
  task before it runs in Python, so that the interpreter is not on its path; the engine
  then only waits for it, in order.
- RequestPoller: completes non-blocking point-to-point requests (isend/irecv). They are
  posted at once on the caller's thread (so paired sends and receives never deadlock) and a
  thread tests them, which also drives MPI's progress while the caller computes.

Everything blocking in these threads (MPI waits, the C++ kernels) releases the GIL.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import traceback
import weakref
from collections import deque

from mpi4py import MPI

from . import _C
from .errors import CommError, CommTimeoutError

# A progress thread's scheduler slice: woken (by a peer, the network, a new call) on a core
# the caller computes on, it runs within microseconds instead of after the caller's slice
# (csrc/process.h's request_slice; Linux 6.12+, elsewhere nothing changes)
PROGRESS_SLICE_NS = 100_000


class Work:
    """Handle of an asynchronous operation; ``result`` holds its return value when done, and
    a receive's ``source`` the rank its message came from."""

    def __init__(self, what: str, source: int | None = None):
        self.what = what
        self.result = None
        self.source = source
        self._exception: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list | None = []
        # a job a transport's thread runs, whose completion this Work records
        # (ProgressEngine.run_job): it says whether it is over before the engine has
        # recorded it, and a waiter may record it itself
        self._job: "_Queued | None" = None

    def __repr__(self):
        state = "failed" if self._exception else "done" if self.is_completed() else "pending"
        return f"<commlib.Work {self.what} {state}>"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (at most ``timeout`` seconds); re-raise the operation's error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._job
        if job is not None and not self._done.is_set() and job.settle(timeout):
            task = job.take()  # (None: the engine's thread has it)
            if task is not None:
                self._run(task)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._done.wait(left):
            raise CommTimeoutError(f"{self.what} did not complete within {timeout} s "
                                   "(it keeps running; a peer may not have issued it)")
        if self._exception is not None:
            raise self._exception
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() or (self._job is not None and self._job.done())

    def exception(self) -> BaseException | None:
        """The error the operation raised, or None (also while it is still running)."""
        return self._exception if self._done.is_set() else None

    def add_done_callback(self, fn) -> None:
        """Call ``fn(work)`` once when done: from the progress thread, or now if already done."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                if self._job is not None:
                    self._job.wake()  # (its engine records it, then calls fn)
                return
        fn(self)

    def _run(self, task) -> None:
        """Run the task that completes this Work (the engine's, or a waiter's)."""
        error = None
        try:
            task()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            error = e
        self._finish(self.result, error)

    def _finish(self, result=None, exception: BaseException | None = None) -> None:
        with self._lock:
            self.result, self._exception = result, exception
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a user's callback must not kill the engine
                traceback.print_exc()


def wait_all(works, timeout: float | None = None) -> None:
    """Wait for every work (``timeout`` bounds the whole call); raise the first error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    first_error = None
    for w in works:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            w.wait(left)
        except CommTimeoutError:
            raise
        except BaseException as e:  # noqa: BLE001 - keep waiting for the rest, then raise
            first_error = first_error or e
    if first_error is not None:
        raise first_error


class Deadline:
    """When a call must be over: ``seconds`` from now (0 or None: never)."""

    __slots__ = ("seconds", "at")

    def __init__(self, seconds: float | None):
        self.seconds = seconds or 0.0
        self.at = time.monotonic() + self.seconds if self.seconds else None

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


# Requests abandoned at a timeout: MPI may still use their buffers, so both stay alive.
_abandoned: list = []


def wait_request(request: MPI.Request, deadline: Deadline, waiting_for: str,
                 status: MPI.Status | None = None, keep=None, cancel: bool = True) -> None:
    """Wait for an MPI request until ``deadline``. MPI has no timed wait, and a
    non-blocking operation progresses only while MPI is called, so this polls back to
    back (as MPI's own blocking wait spins), letting other threads run in between. On
    expiry the request is abandoned with ``keep`` (its buffers; a receive is cancelled
    first, a send, ``cancel=False``, not), and CommTimeoutError names ``waiting_for``.
    Off the main thread (an async call's, beside the caller's compute) it naps between
    polls after the first 64, 10 us doubling to 100 us: back to back, an async 16 MiB
    all_reduce's polls at 1 Gbit/s took 72% of the core the caller computed on; 100 us
    of a 1 Gbit/s link is 12 KB, less than the sockets hold."""
    polls, nap = 0, 1e-5
    beside = threading.current_thread() is not threading.main_thread()
    while not request.Test(status):
        polls += 1
        if polls % 64 == 0 and deadline.expired():
            _abandon(request, keep, cancel)
            raise CommTimeoutError(f"timed out after {deadline.seconds:g} s waiting for "
                                   f"{waiting_for}")
        if beside and polls > 64:
            time.sleep(nap)
            nap = min(2 * nap, 1e-4)
        else:
            os.sched_yield()  # lets the GIL go (time.sleep(0) would nap for ~0.4 ms)


def keep_for_good(buffers) -> None:
    """Keep ``buffers`` alive for good: a request the C++ fast path left to MPI after a
    timeout may still write them."""
    _abandoned.append((None, buffers))


def _abandon(request: MPI.Request, keep, cancel: bool = True) -> None:
    """Leave ``request`` to MPI with ``keep`` (its buffers) alive; a receive nobody matched
    is cancelled first (not a send: cancelling one, deprecated since MPI 4.1, crashed
    MPICH here)."""
    if cancel:
        try:
            request.Cancel()
        except MPI.Exception:
            pass
    _abandoned.append((request, keep))


def finished(what: str, result=None) -> Work:
    """A Work that is already complete."""
    work = Work(what)
    work._finish(result)
    return work


def in_thread(what: str, task, work: Work | None = None) -> Work:
    """Run ``task()`` on a thread of its own; the Work (``work``, or a new one) holds what it
    returns. For blocking operations that must not wait behind one another (receives
    through a store)."""
    work = work or Work(what)

    def run():
        try:
            result = task()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            work._finish(None, e)
        else:
            work._finish(result)
    threading.Thread(target=run, name=f"commlib-{what}", daemon=True).start()
    return work


NATIVE_THREADS = frozenset({"commlib-proxy"})  # the OS names of the C++ threads (csrc/net.cpp)


def own_cpu_seconds() -> float:
    """CPU seconds commlib's own threads in this process have spent so far (progress
    engines and pollers, named commlib-*, and the transports' C++ threads: NATIVE_THREADS),
    to the nanosecond (schedstat): what a caller takes from its process's to tell its own
    compute from commlib's."""
    ids = {t.native_id for t in threading.enumerate() if t.name.startswith("commlib")}
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if int(tid) not in ids:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() not in NATIVE_THREADS:
                        continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # (ended meanwhile)
            continue
    return total / 1e9


_live_threads: "weakref.WeakSet" = weakref.WeakSet()


DRAIN_SECONDS = 30


@atexit.register
def _drain_at_exit():
    """Finish outstanding work before MPI finalizes (mpi4py's atexit hook runs after ours);
    bounded, so work that can never complete (a peer never issued it) cannot hang exit."""
    deadline = time.monotonic() + DRAIN_SECONDS
    for owner in list(_live_threads):
        owner.close(max(0.0, deadline - time.monotonic()))


class _Background:
    """A lazily started daemon thread running the subclass's ``_loop``, and its shutdown."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()  # taken directly on hot paths; _cv waits on it
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None

    def _start(self):  # call with self._cv held
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"commlib-{self._name}",
                                            daemon=True)
            _live_threads.add(self)
            self._thread.start()

    def _run(self):
        _C.request_slice(PROGRESS_SLICE_NS)
        self._loop()

    def close(self, timeout: float | None = None) -> None:
        """Finish what is outstanding, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class ProgressEngine(_Background):
    """Runs one communicator's collectives in issue order."""

    def __init__(self, name: str, on_busy=None):
        super().__init__(f"coll-{name}")
        self._queue: deque = deque()
        self._busy = False  # a task is running, on the engine thread or inline
        self._on_busy = on_busy  # on_busy(1) when work arrives at an idle engine, (-1) at idle
        self._in_python = 0  # tasks queued or running that are not waits for submitted jobs

    def _idle(self) -> bool:  # with the lock held
        return not self._busy and not self._queue

    def _task_ended(self, python: bool) -> None:  # with the lock held
        self._busy = False
        self._in_python -= python
        if self._on_busy is not None and self._idle():
            self._on_busy(-1)

    def run(self, what: str, task, async_op: bool, result=None):
        """Run ``task()`` after everything issued before it; then return ``result`` (a Work
        holding it, if ``async_op``)."""
        with self._lock:
            inline, work = self._enqueue(what, task, async_op, result, python=True)
        return self._complete(inline, work, task, async_op, result, python=True)

    def run_job(self, what: str, submit, finish, async_op: bool, result=None):
        """As run, for a call its transport runs as a job: ``submit(now)`` hands it over
        (or, ``now``, to run on this thread) and returns it (Transport.submit),
        ``finish(job)`` waits for it (and records it). A blocking call with nothing before
        it runs at once; else it is submitted now where nothing issued before it runs in
        Python (the jobs run in issue order; its Work is completed as soon as the job is
        done), else by its task, in its turn."""
        with self._lock:
            if self._closed:
                raise CommError(f"{what} issued on a freed communicator")
            python = self._in_python > 0
            job = None
            if not async_op and self._idle():  # the caller runs it, at once
                task = lambda: finish(submit(True))  # noqa: E731
            elif python:
                task = lambda: finish(submit(False))  # noqa: E731
            else:
                job = submit(False)
                task = lambda: finish(job)  # noqa: E731
            # (a job submitted here needs the engine's thread only to be recorded: its
            # waiter records it itself, so the thread is woken only for callbacks)
            inline, work = self._enqueue(what, task, async_op, result, python,
                                         wake=job is None)
            if work is not None and job is not None:
                work._job = _Queued(self, self._queue[-1], job)
        return self._complete(inline, work, task, async_op, result, python)

    def _take(self, entry):
        """``entry``'s task, taken off the queue (a waiter runs it), or None: the engine's
        thread took it."""
        with self._lock:
            try:
                self._queue.remove(entry)
            except ValueError:
                return None
            if self._on_busy is not None and self._idle():
                self._on_busy(-1)
            return entry[1]

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _enqueue(self, what, task, async_op, result, python, wake=True):  # with the lock held
        """(whether the caller runs ``task`` itself, else the Work queued for it); ``wake``:
        the engine's thread at once."""
        if self._closed:
            raise CommError(f"{what} issued on a freed communicator")
        self._in_python += python
        inline = not async_op and self._idle()
        if self._on_busy is not None and self._idle():
            self._on_busy(1)
        if inline:
            self._busy = True
            return True, None
        work = Work(what)
        work.result = result
        self._queue.append((work, task, python))
        self._start()
        if wake:
            self._cv.notify_all()
        return False, work

    def _complete(self, inline, work, task, async_op, result, python):
        if inline:
            try:
                task()
                return result
            finally:
                with self._lock:
                    self._task_ended(python)
                    if self._queue:  # async work queued meanwhile: wake the engine thread
                        self._cv.notify_all()
        if async_op:
            return work
        work.wait()
        return work.result

    def _loop(self):
        while True:
            with self._cv:
                while self._busy or not self._queue:
                    if self._closed and not self._queue:
                        return
                    self._cv.wait()
                work, task, python = self._queue.popleft()
                self._busy = True
            error = None
            try:
                task()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                error = e
            with self._cv:
                self._task_ended(python)
                self._cv.notify_all()
            work._finish(work.result, error)
            # the task's arrays and events go here, not when the next one is taken
            del work, task, error, python


class _Queued:
    """A job submitted at once (ProgressEngine.run_job) as its Work sees it: whether it is
    over, settling it (waiting for it to be over), taking its task off the engine's queue,
    waking the engine to record it."""

    __slots__ = ("engine", "entry", "job")

    def __init__(self, engine, entry, job):
        self.engine, self.entry, self.job = engine, entry, job

    def done(self) -> bool:
        return self.job.done()

    def settle(self, timeout: float | None) -> bool:
        return self.job.settle(timeout)

    def take(self):
        return self.engine._take(self.entry)

    def wake(self) -> None:
        self.engine._wake()


class RequestPoller(_Background):
    """Completes MPI point-to-point requests in a background thread."""

    SPIN_SECONDS = 2e-3  # poll back-to-back this long after the last completion, then nap
    NAP_SECONDS = 50e-6

    def __init__(self, name: str):
        super().__init__(f"p2p-{name}")
        self._pending: list = []  # (request, work, expected bytes or None, deadline, keep)

    def track(self, request: MPI.Request, what: str, result, expect_bytes=None,
              deadline: Deadline | None = None, keep=None) -> Work:
        """A Work for ``request``; past ``deadline`` it fails with CommTimeoutError and the
        request is abandoned with ``keep`` (its buffer). A receive (``expect_bytes``) notes
        its message's source."""
        work = Work(what)
        work.result = result
        with self._cv:
            self._pending.append((request, work, expect_bytes, deadline, keep))
            self._start()
            self._cv.notify_all()
        return work

    def _expire(self) -> None:
        """Fail the works whose deadline has passed."""
        now = time.monotonic()
        with self._cv:
            expired = [p for p in self._pending if p[3] is not None and p[3].at is not None
                       and now >= p[3].at]
            gone = {id(p) for p in expired}
            self._pending = [p for p in self._pending if id(p) not in gone]
        for request, work, expect_bytes, deadline, keep in expired:
            _abandon(request, keep, cancel=expect_bytes is not None)  # receives only
            work._finish(None, CommTimeoutError(f"{work.what} did not complete within "
                                                f"{deadline.seconds:g} s"))

    def _loop(self):
        last_progress = time.monotonic()
        while True:
            with self._cv:
                while not self._pending:
                    if self._closed:
                        return
                    self._cv.wait()
                batch = list(self._pending)
            statuses = [MPI.Status() for _ in batch]
            try:
                done = MPI.Request.Testsome([p[0] for p in batch], statuses) or []
            except MPI.Exception as e:
                done, failure = list(range(len(batch))), CommError(f"point-to-point failed: {e}")
            else:
                failure = None
            if done:
                finished = {id(batch[i][0]) for i in done}
                with self._cv:
                    self._pending = [p for p in self._pending if id(p[0]) not in finished]
                for k, i in enumerate(done):  # statuses[k] belongs to the k-th completion
                    _, work, expect, _, _ = batch[i]
                    error = failure
                    if error is None and expect is not None:
                        work.source = statuses[k].Get_source()
                        got = statuses[k].Get_count(MPI.BYTE)
                        if got != expect:
                            error = CommError(f"{work.what}: got {got} bytes, the tensor holds "
                                              f"{expect}")
                    work._finish(work.result, error)
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.SPIN_SECONDS:
                self._expire()
                time.sleep(self.NAP_SECONDS)
            else:
                time.sleep(0)  # yield the GIL and the core to the caller's compute

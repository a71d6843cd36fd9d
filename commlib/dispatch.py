"""One route for every collective call of a communicator: validate (commlib/call.py),
choose, record, agree with the peers, run on the transport, in issue order on the
progress engine. A rank whose arguments are invalid still joins the call's agreement
(``tell_peers``), so that its peers raise at once instead of waiting until the timeout.

Calls on GPU arrays take the GPU's own algorithms where one applies: CUDA IPC (work on the
caller's stream, meetings on the engine) or a CUDA-aware MPI on the device memory itself;
else they are staged through pinned host memory (commlib/cuda/staging.py).
"""
from __future__ import annotations

import threading

from mpi4py import MPI

from . import tracer, transports
from .call import check_timeout, default_timeout, invalid_descriptor, make
from .errors import CollectiveMismatchError, CommError, CommTimeoutError
from .fast_path import FastPath
from .recorder import FlightRecorder
from .algorithms import candidates
from .select import Choice, choose_on_device, runnable
from .work import ProgressEngine


def _decline(*args) -> bool:
    return False  # no fast path: every call takes the general one


class Dispatcher:
    """A communicator's calls over ``transport``: its progress engine, flight recorder,
    fast path, failure, and the GPU's transports and staging."""

    def __init__(self, transport, owner: str):
        self.transport = transport
        Choice.give(transport)
        self.recorder = FlightRecorder(owner)
        self.failure: str | None = None  # why the communicator can no longer be used
        self.timeout = default_timeout()  # (set_timeout: also the fast path's)
        self.fast = FastPath.create(transport, self, self.timeout)
        self.recorder.fast = self.fast
        self.call_fast = self.fast.call if self.fast is not None else _decline
        name = f"r{transport.rank}of{transport.size}"
        # the fast path must not overtake the engine's work
        self.engine = ProgressEngine(name, self.fast.native.hold if self.fast else None)
        self._staging = None  # for calls on GPU memory, made at the first one
        self._gpus: dict = {}  # device -> transports.cuda_ipc.CudaIpc, set up at first use
        self._gpu_lock = threading.Lock()
        self.closed = False

    def set_timeout(self, seconds) -> None:
        self.timeout = check_timeout(seconds)
        if self.fast is not None:
            self.fast.native.timeout = self.timeout

    def use_table(self, table) -> None:
        """Choose by ``table`` (table.Table) from now on: what auto chose before, it forgets."""
        self.transport.choice.use(table)
        self.transport.use_table(table)
        if self.fast is not None:
            self.fast.forget_auto()

    def see_regions(self) -> None:
        """The communicator handed out memory every rank maps (Communicator.empty): auto
        weighs one_copy there from now on (select.Choice.see_regions); what it chose
        before, it forgets. On every rank alike: the calls are collective."""
        if not self.transport.choice.regions:
            self.transport.choice.see_regions()
            if self.fast is not None:
                self.fast.forget_auto()

    @property
    def staging(self):
        """How calls on GPU memory pass through the host (commlib/cuda/staging.py)."""
        if self._staging is None:
            from .cuda.staging import Staging
            self._staging = Staging()
        return self._staging

    # ------------------------------------------------------------------ the route
    def dispatch(self, collective: str, algorithm, async_op: bool, timeout, result, **args):
        """Run ``collective`` on ``args`` (call.make's); returns ``result``, or a Work if
        ``async_op``."""
        self.check_open()
        t = self.transport
        try:
            call = make(collective, t.size, t.rank, **args)
            seconds = self.timeout if timeout is None else check_timeout(timeout)
            if call.device is not None:
                return self._on_device(call, algorithm, async_op, seconds, result)
            algo, plan, teach = t.choice(call, algorithm, teaching=True)
        except (ValueError, TypeError) as e:
            self.tell_peers(collective, e)
            raise
        if teach and self.fast is not None:
            staged = algo.otherwise and t.plan(algo.otherwise, call)  # (one_copy's: pages.py)
            self.fast.learn(call, algorithm, algo, plan, staged)
        if t.submits(algo, call) and self.failure is None:
            return self._submit(call, algo, plan, seconds, async_op, result)
        return self.engine.run(collective, self._task(call, algo, plan, seconds), async_op,
                               result)

    def _submit(self, call, algo, plan, seconds, async_op, result):
        """The call as a job of the transport's own thread (Transport.submit), handed over
        as soon as nothing before it runs in Python: the engine's task waits for it and
        records how it ended (after it ended, whatever happened meanwhile: its buffers are
        the job's until then)."""
        t, record, what = self.transport, self._record(call, algo), \
            f"{call.collective} ({algo.name})"

        def finish(job):
            if self.failure is not None:
                try:
                    job.wait()
                except CommError:
                    pass
                raise self.finish(record, self.unusable())
            times = []
            self.run_recorded(record, what, lambda: times.extend(job.wait()))
            record.started, record.finished = times  # when the transport's thread ran it
        return self.engine.run_job(
            call.collective, lambda now: t.submit(call, algo, plan, seconds, now), finish,
            async_op, result)

    def _record(self, call, algo):
        return self.recorder.issue(call.collective, algo.name, call.count, call.dtype.name,
                                   call.op.value if call.op else None, call.root)

    def _task(self, call, algo, plan, seconds):
        """The call as the engine's task: recorded now, bounded, agreed on, run; after
        ``before()`` where the task is given one (a staged call's wait for its stream),
        within the call, so that a timeout there fails the communicator as any does."""
        t, record = self.transport, self._record(call, algo)

        def body(before):
            if before is not None:
                before()
            if t.timeout != seconds:
                t.set_timeout(seconds)
            t.agree_call(call, algo)
            t.run(algo, plan, call)
        return lambda before=None: self.run_recorded(
            record, f"{call.collective} ({algo.name})", lambda: body(before))

    def _on_device(self, call, algorithm, async_op, seconds, result):
        staging, t = self.staging, self.transport
        self._gpu_failures()
        staging.raise_failure()  # raised now: a call returns before it runs
        if self.failure is not None:
            raise self.unusable()
        offers = self._device_offers(call)
        gpu = None
        if "cuda_ipc" in offers and self._asks_ipc(call, algorithm):
            device = call.device.device
            gpu = self.gpu(device, call.descriptor("ipcsetup"), call.dtype.itemsize, seconds)
            if not gpu.usable and algorithm is not None:
                raise CommError(f"{call.collective}: algorithm={algorithm!r} is unavailable "
                                f"here: {gpu.problem}")
            gpu = gpu if gpu.usable else None
        where = gpu.where if gpu is not None else t.where
        algo = choose_on_device(call, algorithm, t.size, where,
                                offers if gpu is not None else offers - {"cuda_ipc"}, gpu)
        if algo is not None and algo.needs == "cuda_ipc":
            return self._through(gpu, call, algo, async_op, seconds, result)
        if algo is not None:  # MPI's own, on the device memory itself: staged in place
            staged = staging.in_place(call)
            host_call, plan = staged.call, None
        else:
            staged = staging.stage(call, t.rank)
            host_call = staged.call
            algo, plan, _ = t.choice(host_call, algorithm)
        return staging.issue(self.engine, call.collective,
                             self._task(host_call, algo, plan, seconds), staged, async_op,
                             result, seconds)

    def _device_offers(self, call) -> frozenset:
        """What ``call`` on GPU arrays may use here: the GPU's own ways, less those its op
        keeps on the host (staged)."""
        t = self.transport
        offers = t.offers | t.device_offers()
        if call.op is not None and t.rank_order:
            offers -= {"cuda_ipc", "cuda_mpi"}  # reduced in rank order on the host, staged
        if call.op is not None and call.op.host_only:  # (the GPU kernels lack bitwise and
            offers -= {"cuda_ipc"}                      # user-defined ops)
        return offers

    def runnable(self, collective: str, nbytes: int, op=None, call=None) -> list:
        """The algorithms that can run a call of ``collective`` on ``nbytes`` primary bytes
        with ``op`` here, in this communicator's mode: what auto chooses among and what
        ``algorithm=`` may name. On ``call``'s GPU arrays (call.make's) also the GPU's own
        that apply: CUDA IPC's unless it failed to set up on that device, zerocopy where
        the input is registered; the host ones run staged."""
        t = self.transport
        user_op = op is not None and not op.builtin
        found = runnable(collective, t.size, nbytes, t.where, t.offers, user_op, t.rank_order)
        if call is not None and call.device is not None:
            gpu = self._gpus.get(call.device.device)
            offers = self._device_offers(call)
            if gpu is not None and not gpu.usable:
                offers -= {"cuda_ipc"}
            found += [a for a in candidates(collective, offers, device=True)
                      if a.memory == "device" and (a.applies is None or
                                                   a.applies(gpu, call) is None)]
        return found

    @staticmethod
    def _asks_ipc(call, algorithm) -> bool:
        """Whether the call may go through CUDA IPC: auto, or a name of its algorithms."""
        from .algorithms import entries
        return algorithm is None or any(
            algorithm in (a.name, a.family) and a.needs == "cuda_ipc"
            for a in entries(call.collective, "device").values())

    def _through(self, gpu, call, algo, async_op, seconds, result):
        """Through CUDA IPC: the call's plan goes to the GPU's proxy, which serves its
        meetings; the caller enqueues its work on the stream; the engine waits for the
        proxy to be done with it (without the GIL) to complete its Work and record it."""
        staging = self.staging
        stream = staging.stream_for(call.device, async_op)
        record, what = self._record(call, algo), f"{call.collective} (ipc)"
        on_gpu = gpu.issue(call, algo.name, stream, seconds)
        wait = on_gpu.wait  # (the engine's task holds no buffer: the caller frees them)

        def task():
            times = []
            try:
                self.run_recorded(record, what, lambda: times.extend(wait()))
            except CommError as e:
                self._gpu_failed(gpu, e)
                raise
            record.started, record.finished = times  # when the proxy served it
        work = staging.submit(self.engine, what, task, on_gpu.done, call.device, async_op,
                              result)
        on_gpu.enqueue()
        staging.keep_until(on_gpu.done, [b.obj for b in call.bufs.values()])
        return work

    def _gpu_failures(self) -> None:
        """Each GPU proxy's failure, once, for the call about to be made to raise: a
        timeout leaves the communicator unusable, as on the host."""
        for gpu in self._gpus.values():
            self._gpu_failed(gpu)

    def _gpu_failed(self, gpu, error: CommError | None = None) -> None:
        """If ``gpu``'s proxy has a failure nobody has taken, it is ``error`` (or the
        proxy's own words), for the next call to raise."""
        with self._gpu_lock:  # taken and remembered at once, by the engine or the caller
            failure = gpu.take_failure()
            if failure is None:
                return
            error = error or failure
            if isinstance(error, CommTimeoutError) and self.failure is None:
                self.failure = str(error)
            self.staging.remember(error)

    def gpu(self, device: int, desc: list, itemsize: int, seconds: float):
        """The CUDA IPC transport on ``device`` (``usable``: every rank could map the others'
        memory), set up at its first call ``desc`` once the ranks agree on that call."""
        if device not in self._gpus:
            gpu = transports.load("cuda_ipc")(self.transport, device, self.staging.runtime)
            t = self.transport

            def set_up():
                t.set_timeout(seconds)
                t.agree(desc, None, itemsize)
                gpu.set_up(t.world)
            self.engine.run("ipc set-up", set_up, async_op=False)
            self._gpus[device] = gpu
        return self._gpus[device]

    # ------------------------------------------------------------------ around a call
    def barrier(self, async_op: bool, timeout):
        """Return once every rank has called barrier (a Work if ``async_op``)."""
        self.check_open()
        t = self.transport
        try:
            seconds = self.timeout if timeout is None else check_timeout(timeout)
        except (ValueError, TypeError) as e:
            self.tell_peers("barrier", e)
            raise
        record = self.recorder.issue("barrier", None, 0, None)

        def body():
            t.set_timeout(seconds)
            t.barrier()
        return self.engine.run("barrier", lambda: self.run_recorded(record, "barrier", body),
                               async_op)

    def run_recorded(self, record, what: str, body) -> None:
        """Run ``body()`` as the recorded call ``record`` (refused once the communicator
        failed); MPI's own errors become CommError naming ``what``."""
        if self.failure is not None:
            raise self.finish(record, self.unusable())
        FlightRecorder.start(record)
        try:
            body()
        except MPI.Exception as e:
            raise self.finish(record, CommError(f"{what} failed inside MPI: {e}")) from e
        except CommError as e:
            raise self.finish(record, e)
        FlightRecorder.finish(record)

    def unusable(self) -> CommError:
        return CommError(f"this communicator is unusable after an earlier failure "
                         f"({self.failure}); create a new communicator")

    def check_open(self) -> None:
        if self.closed:
            raise CommError("this communicator has been freed; use a live one")

    def finish(self, record, error: BaseException | None = None):
        """Record how the call ended; returns ``error``. A timeout or disagreement ends the
        communicator (peers may be anywhere in it) and prints the flight record."""
        if isinstance(error, (CommTimeoutError, CollectiveMismatchError)):
            error.args = (f"collective #{record.seq} on rank {self.transport.rank} "
                          f"({record.collective}): {error}",)
            if isinstance(error, CommTimeoutError) and self.failure is None:
                self.failure = str(error)  # (shared memory also poisons it for the peers)
                if self.fast is not None:
                    self.fast.native.hold(1)  # for good
        FlightRecorder.finish(record, error)
        if isinstance(error, (CommTimeoutError, CollectiveMismatchError)):
            self.recorder.dump()
        if isinstance(error, CommError):
            tracer.on_failure(error)
        return error

    def tell_peers(self, collective: str, error: Exception) -> None:
        """Before raising ``error`` (this rank's arguments are invalid), tell the peers, where
        calls are checked: valid ones then raise CollectiveMismatchError naming this rank."""
        t = self.transport
        if t.size == 1 or not t.checks_calls:
            return
        record = self.recorder.issue(collective, "invalid", None, None)

        def body():
            t.set_timeout(self.timeout)
            t.agree(invalid_descriptor(collective))

        try:
            self.engine.run(collective, lambda: self.run_recorded(record, collective, body),
                            async_op=False)
        except CollectiveMismatchError:
            error.add_note("commlib: its peers made a valid call; they raise "
                           "CollectiveMismatchError")
        except CommError as e:
            error.add_note(f"commlib: telling its peers that the call is invalid failed: {e}")

    def abandon(self) -> None:
        """Release what this rank holds, without its peers (some are dead): the calls
        still queued fail, the transport's memory is unmapped."""
        if self.failure is None:
            self.failure = "the communicator was aborted"
        self.transport.interrupt()  # a call in flight ends now, not at its timeout
        self.close()

    def close(self) -> None:
        """Finish outstanding work, then release the transport (collective)."""
        self.engine.close()
        if self._staging is not None:
            for gpu in self._gpus.values():
                gpu.close()
            self._staging.close()
        self.recorder.detach()
        self.fast = None
        self.call_fast = _decline
        self.transport.close()
        self.closed = True


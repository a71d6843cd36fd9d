"""Communicator: a group of ranks over an mpi4py communicator (or, on one host, a store)."""
from __future__ import annotations

import os

import mpi4py

mpi4py.rc.thread_level = "multiple"  # progress threads and concurrent communicators need it
from mpi4py import MPI  # noqa: E402

from . import abort, collectives  # noqa: E402
from .cuda import registered  # noqa: E402
from .calls import Agreement, FlightRecorder, check_timeout, default_timeout  # noqa: E402
from .errors import CollectiveMismatchError, CommError, CommTimeoutError  # noqa: E402
from .exchange import MpiGroup  # noqa: E402
from .executors.python import PythonExecutor  # noqa: E402
from .executors.shm import ShmExecutor  # noqa: E402
from .fast_path import FastPath  # noqa: E402
from .fast_path import enabled as fast_path_enabled  # noqa: E402
from .select import algorithm_overrides, choose  # noqa: E402
from .algorithms import OFFERS  # noqa: E402
from .hosts import HostLayout, count_hosts, crowded_host, requested_transport  # noqa: E402
from .store import StoreGroup, StoreMailbox, check_one_host  # noqa: E402
from .store import crowded as store_crowded  # noqa: E402
from .work import ProgressEngine, RequestPoller  # noqa: E402


class Communicator:
    """Wraps an mpi4py communicator; every rank of it must construct this together.

    Collectives and point-to-point messages travel on private duplicates of the MPI
    communicator, so they never match the user's own MPI traffic or each other. Every
    operation takes ``async_op``: then it returns a Work at once; collectives on one
    communicator complete in issue order, driven by its own progress thread.
    """

    def __init__(self, mpi_comm: MPI.Comm, _transport: str | None = None):
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL:
            raise TypeError(f"Communicator needs an mpi4py communicator, got {mpi_comm!r}")
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._coll = mpi_comm.Dup()
        self._p2p = mpi_comm.Dup()
        self.transport = _transport or self._pick_transport()
        self.offers = OFFERS[self.transport]
        self._layout = HostLayout(self._coll, Communicator) if self.transport == "hosts" else None
        self._executor = (ShmExecutor(MpiGroup(self._coll), crowded_host())
                          if self.transport == "shm"
                          else PythonExecutor(self._coll))
        self._set_up()

    @classmethod
    def from_store(cls, store, rank: int, size: int, prefix: str = "commlib") -> "Communicator":
        """A communicator of ``size`` processes of this host that meet through ``store``
        (a torch.distributed Store, or anything with its set/get/delete_key), without MPI:
        for launchers such as torchrun that form no MPI world. Collective over the ranks;
        each passes its own ``rank``. Collectives run on shared memory as usual;
        send/recv go through the store (see commlib/store.py)."""
        self = cls.__new__(cls)
        self._group = StoreGroup(store, rank, size, prefix)
        check_one_host(self._group)
        self.mpi = self._coll = None
        self.rank, self.size = rank, size
        self._p2p = StoreMailbox(store, rank, f"{prefix}/p2p")
        self.transport = "shm"
        self.offers = OFFERS["shm"] - {"mpi"}
        self._layout = None
        self._executor = ShmExecutor(self._group, store_crowded(self._group))
        self._set_up()
        return self

    def _set_up(self):
        # bytes_sent beyond the executor's: MPI's own collectives (run one at a time, on
        # the engine), point-to-point sends (on the callers' threads)
        self._native_bytes_sent = self._p2p_bytes_sent = 0
        self.timeout = default_timeout()
        self._recorder = FlightRecorder(repr(self))
        # shared memory checks every call itself (csrc/agreement.h); elsewhere the ranks
        # exchange descriptors first, unless COMMLIB_CHECK=0
        self._check_agreement = (self.transport != "shm"
                                 and os.environ.get("COMMLIB_CHECK", "1") != "0")
        self._agreement = Agreement(self._coll) if self._check_agreement else None
        self._failure: str | None = None  # why this communicator can no longer be used
        self._overrides = algorithm_overrides()
        self._plans: dict = {}
        self._fast = None
        if fast_path_enabled(self.transport):
            self._fast = self._recorder.fast = FastPath(self, self._recorder.calls.maxlen)
        name = f"r{self.rank}of{self.size}"
        # the fast path must not overtake the engine's work
        self._engine = ProgressEngine(name, self._fast.native.hold if self._fast else None)
        self._poller = RequestPoller(name)
        self._staging = None  # for calls on GPU memory, made at the first one

    @property
    def staging(self):
        """How this communicator's calls on GPU memory pass through the host (cuda/staging.py)."""
        if self._staging is None:
            from .cuda.staging import Staging
            self._staging = Staging()
        return self._staging

    def __repr__(self):
        return f"<commlib.Communicator rank {self.rank} of {self.size} over {self.transport}>"

    @property
    def timeout(self) -> float:
        """Seconds any call on this communicator may wait for its peers before it raises
        CommTimeoutError (0: no limit); COMMLIB_TIMEOUT by default, ``timeout=`` per call."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = check_timeout(seconds)
        if getattr(self, "_fast", None) is not None:
            self._fast.native.timeout = self._timeout

    def flight_record(self) -> list[dict]:
        """The last calls on this communicator, oldest first (calls.FlightRecorder)."""
        return self._recorder.records()

    def _run_recorded(self, record, what: str, body) -> None:
        """Run ``body()`` as the recorded call ``record`` (refused once this communicator
        failed); MPI's own errors become CommError naming ``what``."""
        if self._failure is not None:
            raise self._finish(record, self._unusable())
        FlightRecorder.start(record)
        try:
            body()
        except MPI.Exception as e:
            raise self._finish(record, CommError(f"{what} failed inside MPI: {e}")) from e
        except CommError as e:
            raise self._finish(record, e)
        FlightRecorder.finish(record)

    def _unusable(self) -> CommError:
        return CommError(f"this communicator is unusable after an earlier failure "
                         f"({self._failure}); create a new communicator")

    def _finish(self, record, error: BaseException | None = None):
        """Record how the call ended; returns ``error``. A timeout or disagreement ends the
        communicator (peers may be anywhere in it) and prints the flight record."""
        if isinstance(error, (CommTimeoutError, CollectiveMismatchError)):
            error.args = (f"collective #{record[0]} on rank {self.rank} ({record[1]}): "
                          f"{error}",)
            if isinstance(error, CommTimeoutError) and self._failure is None:
                self._failure = str(error)  # (shared memory also poisons it for the peers)
                if self._fast is not None:
                    self._fast.native.hold(1)  # for good
        FlightRecorder.finish(record, error)
        if isinstance(error, (CommTimeoutError, CollectiveMismatchError)):
            self._recorder.dump()
        return error

    def _pick_transport(self) -> str:
        """shm on one host, hosts across evenly filled hosts, else mpi (see hosts.py)."""
        requested = requested_transport()
        if requested == "mpi":
            return "mpi"
        hosts, even = count_hosts(self._coll)
        if hosts == 1:
            return "shm"
        if requested == "shm":
            raise ValueError(f"COMMLIB_TRANSPORT=shm, but this communicator spans {hosts} hosts; "
                             "use auto or mpi")
        return "hosts" if even else "mpi"

    def _plan(self, collective: str, requested, count: int, itemsize: int, params: tuple):
        """(algorithm, plan or None for runners) of a call, cached on this communicator."""
        key = (collective, requested, count, itemsize, params)
        hit = self._plans.get(key)
        if hit is None:
            algo = choose(collective, requested or self._overrides.get(collective, "auto"),
                          self.size, count * itemsize, transport=self.transport,
                          local=self._layout.local.size if self._layout else None,
                          offers=self.offers)
            plan = None if algo.run is not None else self._executor.plan(
                algo, self.size, self.rank, count, itemsize, params)
            if len(self._plans) >= 4096:
                self._plans.clear()
            hit = self._plans[key] = (algo, plan)
            if self._fast is not None and requested is None:
                self._fast.learn(collective, algo, plan, count, itemsize, dict(params))
        return hit

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has handed to its peers on this communicator: what its
        executor moved (sent over MPI, pushed into a peer's shared-memory channel, or
        staged there and read by a peer: once per reader), plus point-to-point sends. For
        MPI's own collectives (native), whose internals are hidden, the least that any
        algorithm sends (nccl-tests' bus bytes)."""
        total = self._native_bytes_sent + self._p2p_bytes_sent
        total += self._executor.bytes_sent if self._executor else 0
        if self._layout is not None:
            total += self._layout.local.bytes_sent + self._layout.cross.bytes_sent
        return total

    def algorithms(self, collective: str) -> list[str]:
        """The algorithms ``collective`` can use on this communicator."""
        from .algorithms import algorithms
        return algorithms(collective, self)

    def split(self, color, key=0) -> "Communicator | None":
        """Ranks with equal ``color`` form a new communicator, ordered by (key, rank).
        ``color=None`` opts out: that rank gets None. Collective over this communicator."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                                  or color < 0):
            raise ValueError(f"color must be a non-negative int or None, got {color!r}")
        if self.mpi is None:
            return self._split_store(color, key)
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else Communicator(sub)

    def _split_store(self, color, key) -> "Communicator | None":
        group = self._group
        choices = group.allgather([color, key])
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(choices) if c == color)
        rank = members.index((key, self.rank))
        return Communicator.from_store(group.store, rank, len(members),
                                       f"{group.prefix}/split{group.rounds}/{color}")

    def dup(self) -> "Communicator":
        """A new communicator over the same ranks, with traffic separate from this one."""
        if self.mpi is None:
            return self._split_store(0, self.rank)
        return Communicator(self.mpi.Dup())

    def free(self) -> None:
        """Finish outstanding work, then release the private MPI communicators (collective)."""
        self._engine.close()
        self._poller.close()
        if self._staging is not None:
            self._staging.close()
        if self._layout is not None:
            self._layout.free()
        self._recorder.detach()
        self._executor = self._fast = None  # unmaps shared memory
        if self._agreement is not None:
            self._agreement.free()
        for c in (self._coll, self._p2p):
            if isinstance(c, MPI.Comm) and c != MPI.COMM_NULL:
                c.Free()

    def all_reduce(self, t, op="sum", algorithm=None, async_op=False, timeout=None):
        return collectives.all_reduce(t, op, algorithm, self, async_op, timeout)

    def reduce_scatter(self, output, input, op="sum", algorithm=None, async_op=False,
                       timeout=None):
        return collectives.reduce_scatter(output, input, op, algorithm, self, async_op, timeout)

    def all_gather(self, output, input, algorithm=None, async_op=False, timeout=None):
        return collectives.all_gather(output, input, algorithm, self, async_op, timeout)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, algorithm=None,
                   async_op=False, timeout=None):
        return collectives.all_to_all(output, input, output_splits, input_splits, algorithm,
                                      self, async_op, timeout)

    def broadcast(self, t, root=0, algorithm=None, async_op=False, timeout=None):
        return collectives.broadcast(t, root, algorithm, self, async_op, timeout)

    def reduce(self, t, root=0, op="sum", algorithm=None, async_op=False, timeout=None):
        return collectives.reduce(t, root, op, algorithm, self, async_op, timeout)

    def barrier(self, async_op=False, timeout=None):
        return collectives.barrier(self, async_op, timeout)

    def register(self, t, timeout=None):
        """GPU memory the ranks of one host read and write directly (zero-copy collectives);
        collective. Returns a RegisteredMemory: close() it, or use it as a context manager."""
        return registered.register(self, t, timeout)

    def send(self, t, dst, tag=0, async_op=False, timeout=None):
        return collectives.send(t, dst, tag, self, async_op, timeout)

    def recv(self, t, src, tag=0, async_op=False, timeout=None):
        return collectives.recv(t, src, tag, self, async_op, timeout)


_world: Communicator | None = None


def init() -> Communicator:
    """The world communicator over MPI.COMM_WORLD (created on first call, then reused)."""
    global _world
    if _world is None:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("commlib needs MPI_THREAD_MULTIPLE; MPI was initialised with "
                               "a lower thread level before commlib was imported")
        _world = Communicator(MPI.COMM_WORLD)  # collective: every rank is past MPI_Init
        abort.unlink_mpich_segments()  # so a rank killed from now on leaves nothing behind
        abort.install()  # an uncaught exception on any rank then ends the job
    return _world

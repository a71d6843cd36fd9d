"""Communicator: a group of ranks and the collectives among them (also as functions of the
world), over one transport (commlib/transports/), every call through one route
(commlib/dispatch.py)."""
from __future__ import annotations

import math
import os

import mpi4py
import numpy as np

mpi4py.rc.thread_level = "multiple"  # progress threads and concurrent communicators need it
from mpi4py import MPI  # noqa: E402

from . import abort, p2p, tracer, transports, tuning  # noqa: E402
from .call import NONE, ReduceOp, check_timeout, descriptor, make  # noqa: E402
from .collectives import (CODES, NAMES as COLLECTIVE_NAMES, REDUCING,  # noqa: E402
                          ROOTED)
from .dispatch import Dispatcher  # noqa: E402
from .dtypes import DTYPES, NAMES  # noqa: E402
from .errors import CommError  # noqa: E402
from .host_memory import as_array  # noqa: E402
from .transports.mpi_world import MpiWorld  # noqa: E402

# alone in its MPI world (torchrun's ranks, a store's): MPICH's node segment is its alone
if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() == 1:
    abort.unlink_mpich_segments()

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL, BROADCAST, REDUCE = (
    CODES[c] for c in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                       "reduce"))


class Communicator:
    """Wraps an mpi4py communicator; every rank of it must construct this together. Its
    traffic never matches the user's own MPI traffic. With ``async_op`` an operation
    returns a Work at once; a communicator's collectives complete in issue order."""

    def __init__(self, mpi_comm: MPI.Comm):
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL:
            raise TypeError(f"Communicator needs an mpi4py communicator, got {mpi_comm!r}")
        self._over(MpiWorld(mpi_comm).make_transport())

    @classmethod
    def from_store(cls, store, rank: int, size: int, prefix: str = "commlib") -> "Communicator":
        """A communicator of ``size`` processes that meet through ``store`` (a
        torch.distributed Store) instead of MPI, for launchers such as torchrun; collective,
        each rank passing its own ``rank``. On one host they share memory
        (commlib/transports/store.py); across hosts TCP joins them (transports/net.py; gloo
        with COMMLIB_CROSS=gloo)."""
        return cls.__new__(cls)._over(transports.load("store").create(store, rank, size, prefix))

    def _over(self, transport, may_measure: bool = True) -> "Communicator":
        """This communicator over ``transport``; its layout's table measured unless there is
        one, or ``may_measure`` is False (a shrunk one: recovery must be quick)."""
        self._transport = transport
        self.rank, self.size, self.mpi = transport.rank, transport.size, transport.world.mpi
        self._calls = Dispatcher(transport, repr(self))
        self._calls.recorder.identify(transport.world.members)
        self._fast = self._calls.call_fast
        self._tune(may_measure=may_measure)
        return self

    def _tune(self, refresh: bool = False, may_measure: bool = True) -> None:
        """Choose by the algorithm table of this layout (commlib/tuning.py) from now on."""
        table = tuning.table_for(self, self._transport, refresh, may_measure)
        if table is not None:
            self._calls.use_table(table)

    def __repr__(self):
        return f"<commlib.Communicator rank {self.rank} of {self.size} over {self.transport}>"

    @property
    def transport(self) -> str:
        """The name of what this communicator runs over: shm, mpi or hosts."""
        return self._transport.name

    @property
    def offers(self) -> frozenset:
        """What its transport offers algorithms (commlib.algorithms.NEEDS)."""
        return self._transport.offers

    @property
    def timeout(self) -> float:
        """Seconds any call on this communicator may wait for its peers before it raises
        CommTimeoutError (0: no limit); COMMLIB_TIMEOUT by default, ``timeout=`` per call."""
        return self._calls.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._calls.set_timeout(seconds)

    @property
    def algorithm_table(self):
        """The algorithm table measured for this communicator's layout (table.Table:
        ``times[collective][algorithm]`` is [[bytes, seconds], ...]), or None where auto
        uses the cost model (COMMLIB_TUNING=off, one rank)."""
        return self._transport.choice.measured

    @algorithm_table.setter
    def algorithm_table(self, table) -> None:
        """Choose by ``table`` (a table.Table, say measured on another run) from now on;
        collective: rank 0's is taken everywhere, so that no two ranks choose differently."""
        self._calls.use_table(tuning.Table.rank_0s(self._transport.world, table))

    def measure_algorithms(self) -> None:
        """Measure this layout's algorithm table again and cache it for later runs
        (collective; what ``commlib-bench calibrate`` and COMMLIB_TUNING=refresh do)."""
        self._tune(refresh=True)

    def flight_record(self) -> list[dict]:
        """The last calls on this communicator, oldest first (recorder.FlightRecorder)."""
        return self._calls.recorder.records()

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank handed to its peers here: what its transport moved (over MPI, or
        through shared memory: once per reader) and sent; for MPI's own collectives, whose
        internals are hidden, the least any algorithm sends (nccl-tests' bus bytes)."""
        return self._transport.bytes_sent

    def algorithms(self, collective: str, output=None, input=None, *, op="sum", root=0,
                   count: int | None = None, dtype=None, device: bool = False) -> list[str]:
        """The algorithms ``collective`` can use here, on host memory or (``device``) GPUs,
        for some call. Given a call, only those that can run it in this communicator's mode
        (deterministic, its size, its op): what auto chooses among and ``algorithm=`` may
        name. The call is its buffers (``output``, and ``input`` where the collective takes
        two), ``op`` and ``root`` as the collective takes them; or on host memory its
        primary ``count`` (elements of ``t``, of reduce_scatter's ``output``, of
        all_gather's ``input``) and ``dtype``."""
        from .algorithms import candidates
        if count is not None or dtype is not None:
            if output is not None or input is not None:
                raise TypeError("algorithms: give a call's buffers, or its count and dtype, "
                                "not both")
            nbytes = _count_bytes(count, dtype)
            reduce_op = ReduceOp.parse(op) if collective in REDUCING else None
            return sorted({a.name for a in self._calls.runnable(collective, nbytes, reduce_op)})
        if output is not None:
            call = make(collective, self.size, self.rank, output, input,
                        op if collective in REDUCING else None,
                        root if collective in ROOTED else None)
            return sorted({a.name for a in self._calls.runnable(
                collective, call.nbytes, call.op, call)})
        offers = self.offers | (self._transport.device_offers() if device else frozenset())
        return sorted({a.name for a in candidates(collective, offers, device)})

    def split(self, color, key=0, deterministic=None) -> "Communicator | None":
        """Ranks with equal ``color`` form a new communicator, ordered by (key, rank).
        ``color=None`` opts out: that rank gets None. Collective over this communicator.
        ``deterministic``: see ``dup`` (None: as this one)."""
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)
                                  or color < 0):
            raise ValueError(f"color must be a non-negative int or None, got {color!r}")
        world = self._transport.world.split(color, key)
        return None if world is None else self._derived(world, deterministic)

    def dup(self, deterministic=None) -> "Communicator":
        """A new communicator over the same ranks, with traffic separate from this one.
        ``deterministic=True``: its reducing collectives reduce in rank order, so results
        are the same bits whatever the algorithm, transport or size (None: as this one)."""
        return self._derived(self._transport.world.dup(), deterministic)

    def shrink(self, timeout: float | None = None) -> "Communicator":
        """A new communicator of this one's ranks that are still alive, in rank order, for
        the survivors to go on after a peer died (a call naming it raised CommError), or
        on request; collective over the survivors, who agree on themselves through the
        store (commlib/survivors.py). A peer that dies meanwhile fails it on every survivor:
        call it again. Ranks neither alive nor seen to have exited within ``timeout``
        seconds (default: this communicator's, else 60) are left out. This communicator is
        aborted (``abort``). Only for ranks that met through a store
        (``from_store``, torchrun's world): an MPI job ends with any of its ranks."""
        world = self._transport.world
        if not hasattr(world, "shrunk"):
            raise CommError("shrink: this communicator's ranks met through MPI, whose job "
                            "ends when one of them dies (mpiexec stops the rest); make it "
                            "with Communicator.from_store (or run under torchrun) to go on "
                            "without a dead rank")
        seconds = check_timeout(timeout) if timeout is not None else (self.timeout or 60.0)
        transport = transports.load("store").over(world.shrunk(seconds))
        transport.deterministic = self.deterministic
        shrunk = Communicator.__new__(Communicator)._over(transport, may_measure=False)
        self.abort()
        return shrunk

    def abort(self) -> None:
        """End this communicator on this rank now, without its peers (some may be dead):
        calls still queued fail, nothing waits for another rank, its memory is released.
        Where ``free`` is collective, this is what a rank does after a failure. From any
        thread: a call in flight on shared memory fails at once, and its peers' too
        (Transport.interrupt; over MPI or gloo it ends at its timeout or a peer's death)."""
        if not self._calls.closed:
            self._calls.abandon()
        self._fast = self._calls.call_fast

    def _derived(self, world, deterministic) -> "Communicator":
        transport = world.make_transport()
        if deterministic is not None and not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True, False or None, got {deterministic!r}")
        transport.deterministic = (self.deterministic if deterministic is None
                                   else deterministic)
        return Communicator.__new__(Communicator)._over(transport)

    @property
    def deterministic(self) -> bool:
        """Whether reducing calls reduce every element in rank order ((x0 op x1) op x2 ...),
        for bitwise the same results whatever the algorithm, transport, message or segment
        size: the world's from COMMLIB_DETERMINISTIC=1, others' from split or dup."""
        return self._transport.deterministic

    def free(self) -> None:
        """Finish outstanding work, then release the private MPI communicators (collective)."""
        self._calls.close()
        self._fast = self._calls.call_fast

    def try_fast(self, collective: str, output, input=None, op=None, root=None) -> bool:
        """Run the call in one C++ call if the fast path takes it (csrc/fast_path.cpp:
        numpy arrays or plain CPU tensors, a call like one made before, auto's algorithm,
        the communicator's timeout), returning True; False: nothing was done, make the
        call as usual. For layers that add their own cost to every call (the torch
        backend)."""
        return self._fast(CODES[collective], output, input, op, root, None)

    # The collectives: each goes through _collective, the one route of a public call.
    def _collective(self, code: int, result, algorithm, async_op, timeout, out, inp=None,
                    op=None, root=None, splits=None):
        """Run the collective of ``code`` (collectives.CODES), returning ``result`` (a Work if
        ``async_op``): in one C++ call where the fast path takes it (csrc/fast_path.cpp:
        blocking, the communicator's timeout, even parts, a call like one made before), else
        dispatched: validated into a Call and run on the transport. ``splits``:
        all_to_all's input_splits and output_splits, where given."""
        if (timeout is None and not async_op and splits is None
                and self._fast(code, out, inp, op, root, algorithm)):
            return result
        return self._calls.dispatch(COLLECTIVE_NAMES[code], algorithm, async_op, timeout,
                                    result, out=out, inp=inp, op=op, root=root,
                                    **(splits or {}))

    def all_reduce(self, t, op="sum", algorithm=None, async_op=False, timeout=None):
        """Reduce ``t`` over all ranks, in place; returns ``t`` (a Work if ``async_op``)."""
        return self._collective(ALL_REDUCE, t, algorithm, async_op, timeout, t, op=op)

    def reduce_scatter(self, output, input, op="sum", algorithm=None, async_op=False,
                       timeout=None):
        """Reduce ``input`` (size * output.numel elements) over all ranks; rank r keeps
        block r."""
        return self._collective(REDUCE_SCATTER, output, algorithm, async_op, timeout, output,
                                input, op=op)

    def all_gather(self, output, input, algorithm=None, async_op=False, timeout=None):
        """Concatenate every rank's ``input`` into ``output`` (size * input.numel elements)."""
        return self._collective(ALL_GATHER, output, algorithm, async_op, timeout, output,
                                input)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, algorithm=None,
                   async_op=False, timeout=None):
        """Rank r sends input's j-th part to rank j, receiving rank j's r-th part into
        output. Splits count elements per peer (like torch's all_to_all_single); None means
        equal parts."""
        even = input_splits is None and output_splits is None
        return self._collective(ALL_TO_ALL, output, algorithm, async_op, timeout, output,
                                input, splits=None if even else {"input_splits": input_splits,
                                                                 "output_splits": output_splits})

    def broadcast(self, t, root=0, algorithm=None, async_op=False, timeout=None):
        """Copy ``t`` from ``root`` to every rank, in place; returns ``t``."""
        return self._collective(BROADCAST, t, algorithm, async_op, timeout, t, root=root)

    def reduce(self, t, root=0, op="sum", algorithm=None, async_op=False, timeout=None):
        """Reduce ``t`` over all ranks into ``t`` on ``root``; other ranks' ``t`` is
        unchanged."""
        return self._collective(REDUCE, t, algorithm, async_op, timeout, t, op=op, root=root)

    def barrier(self, async_op=False, timeout=None):
        """Return once every rank has called barrier (a Work if ``async_op``)."""
        return self._calls.barrier(async_op, timeout)

    def send(self, t, dst, tag=0, async_op=False, timeout=None):
        """Send ``t`` to rank ``dst``; blocking, or a Work if ``async_op`` (keep ``t`` intact
        until it completes). Fails with CommTimeoutError if ``dst`` has not taken it within
        ``timeout`` seconds (default: the communicator's)."""
        return p2p.send(self._calls, t, dst, tag, async_op, timeout)

    def recv(self, t, src, tag=0, async_op=False, timeout=None):
        """Receive into ``t`` from rank ``src``, or from any rank (``src=None``: the Work's
        ``source`` says which); the message must fill ``t`` exactly. Blocking (returns
        ``t``), or a Work if ``async_op``. Fails with CommTimeoutError if nothing arrives
        within ``timeout`` seconds (default: the communicator's)."""
        return p2p.recv(self._calls, t, src, tag, async_op, timeout)

    def empty(self, shape, dtype=np.float32):
        """An uninitialised array of ``shape`` (numpy; a torch tensor for a torch dtype) in
        host memory that every rank of the host maps, so that one_copy collectives on it
        read the peers' data where it lies (commlib/host_memory.py). Collective: every rank
        asks for the same shape and dtype. Where the ranks share no memory (not the shm
        transport), an ordinary array."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        torch_dtype = type(dtype).__module__ == "torch"
        itemsize = dtype.itemsize if torch_dtype else np.dtype(dtype).itemsize
        memory = self._transport.memory
        if memory is None:
            raw = bytearray(math.prod(shape) * itemsize)
        else:
            nbytes, made = math.prod(shape) * itemsize, []
            desc = descriptor("barrier", "empty", nbytes, NONE, NONE, NONE)

            def allocate():  # once the ranks agree on the size (else all raise, none hangs)
                self._transport.set_timeout(self.timeout)
                self._transport.agree(desc)
                made.append(memory.allocate(nbytes))
            self._calls.engine.run("empty", allocate, async_op=False)
            self._calls.see_regions()
            raw = made[0]
        return as_array(raw, shape, dtype)

    def register(self, t, timeout=None, required: bool = True):
        """GPU memory the ranks of one host read and write directly (zero-copy collectives);
        collective. Returns a RegisteredMemory to close() (or use in a ``with`` block), or,
        not ``required``, None where ``t`` cannot be registered, alike on every rank."""
        from .cuda.registered import register
        return register(self._calls, t, timeout, required)


_world: Communicator | None = None


def init() -> Communicator:
    """The world communicator (created on first call, then reused): over MPI.COMM_WORLD, or
    under torchrun (each process alone in its MPI world) through torchrun's store."""
    global _world
    if _world is not None:
        return _world
    if MPI.COMM_WORLD.size == 1 and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        _world = _torchrun_world()
    else:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("commlib needs MPI_THREAD_MULTIPLE; MPI was initialised with "
                               "a lower thread level before commlib was imported")
        _world = Communicator(MPI.COMM_WORLD)  # collective: every rank is past MPI_Init
        abort.unlink_mpich_segments()  # so a rank killed from now on leaves nothing behind
        abort.install()  # an uncaught exception on any rank then ends the job
    tracer.name_job(_world._transport.world, _world.rank, _world.size)  # (collective)
    tracer.start(_world, _world._calls.recorder)  # (collective) if COMMLIB_TRACE asks
    return _world


def finalize() -> None:
    """Free the world communicator (collective), so that the next init() makes a new one
    from the environment as it is then; MPI itself stays initialised. For a process that
    runs one job after another (the tests' rank pool, tests/mpi/serve.py)."""
    global _world
    if _world is not None:
        world, _world = _world, None
        world.free()
        tracer.end_job()


def _torchrun_world() -> Communicator:
    """The ranks torchrun started, meeting through its store (MASTER_ADDR, MASTER_PORT:
    served by torchrun's agent, or by rank 0 where the agent's store is not in use)."""
    from datetime import timedelta

    import torch.distributed as dist
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=serves, timeout=timedelta(minutes=5))
    # the agent's store outlives a restart of the workers (torchrun --max-restarts): each
    # attempt's keys apart, as torch's own rendezvous keeps them
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = Communicator.from_store(store, rank, size, f"commlib/world/attempt{attempt}")
    world.store = store  # the server, where this rank serves it, lives as long as the world
    return world


# The collectives as functions: each is its communicator's method (and shows that method's
# docstring), ``comm=None`` meaning the world.
def _comm(comm):
    if comm is None:
        return init()
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a commlib.Communicator (or None for the world), got "
                        f"{type(comm).__name__}")
    return comm


def all_reduce(t, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).all_reduce(t, op, algorithm, async_op, timeout)


def reduce_scatter(output, input, op="sum", algorithm=None, comm=None, async_op=False,
                   timeout=None):
    return _comm(comm).reduce_scatter(output, input, op, algorithm, async_op, timeout)


def all_gather(output, input, algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).all_gather(output, input, algorithm, async_op, timeout)


def all_to_all(output, input, output_splits=None, input_splits=None, algorithm=None, comm=None,
               async_op=False, timeout=None):
    return _comm(comm).all_to_all(output, input, output_splits, input_splits, algorithm,
                                  async_op, timeout)


def broadcast(t, root=0, algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).broadcast(t, root, algorithm, async_op, timeout)


def reduce(t, root=0, op="sum", algorithm=None, comm=None, async_op=False, timeout=None):
    return _comm(comm).reduce(t, root, op, algorithm, async_op, timeout)


def barrier(comm=None, async_op=False, timeout=None):
    return _comm(comm).barrier(async_op, timeout)


def send(t, dst, tag=0, comm=None, async_op=False, timeout=None):
    return _comm(comm).send(t, dst, tag, async_op, timeout)


def recv(t, src, tag=0, comm=None, async_op=False, timeout=None):
    return _comm(comm).recv(t, src, tag, async_op, timeout)


for _fn in (all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, reduce, barrier,
            send, recv):
    _fn.__doc__ = getattr(Communicator, _fn.__name__).__doc__


def _count_bytes(count, dtype) -> int:
    """The bytes of ``count`` elements of ``dtype`` (a name, numpy's or torch's)."""
    if count is None or dtype is None:
        raise TypeError("algorithms: a call given by its size needs both count and dtype")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"algorithms: count must be a non-negative int, got {count!r}")
    if type(dtype).__module__ == "torch":
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = dtype if dtype in DTYPES else np.dtype(dtype).name
        except TypeError:
            name = None
    if name not in DTYPES:
        raise ValueError(f"algorithms: dtype {dtype!r} is not one commlib communicates; "
                         f"valid: {NAMES}")
    return count * DTYPES[name].itemsize

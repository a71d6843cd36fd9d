"""net: ranks on several hosts joined by TCP (csrc/net.h), one connection per pair, made
at set-up from the addresses the world's ranks exchange. Schedules run flattened into the
int64 plans csrc/net.h documents; calls are agreed on over the same connections, small
ones carry their data there (eager), and MPI's own collectives (native) run after that
agreement where the world is MPI's. Every wait sleeps in poll() without the GIL, so an
async call moves its bytes on the progress engine's thread while the caller computes, and
spends no core while the link is the bound.

It joins the hosts whether the ranks met through MPI (mpiexec) or through a store
(torchrun: commlib/transports/store.py). COMMLIB_CROSS names what joins them instead, as
before this transport: mpi under mpiexec (the mpi transport, and the hosts transport's MPI
form), gloo under torchrun (transports/gloo.py).

Which address a rank is reached at: COMMLIB_SOCKET_IFNAME's interface (as NCCL's
NCCL_SOCKET_IFNAME), else its hostname's address where that is not a loopback one, else
its first interface that is up and not loopback.
"""
from __future__ import annotations

import fcntl
import secrets
import socket
import struct
from dataclasses import dataclass


from .. import _C, settings, survivors
from ..call import NONE, default_timeout, descriptor
from . import rows
from .mpi import MpiTransport, use_native
from .mpi_world import MpiWorld
from .plans import net_plan

SET_UP_SECONDS = 120.0  # for the peers to connect, where COMMLIB_TIMEOUT sets no limit
SPIN_SECONDS = 50e-6  # a wait's polls back to back before it sleeps (where cores allow)


class Links:
    """This rank's connections to its peers (the C++ NetComm as ``native``): the
    agreement's rows and the plans' transfers both travel them."""

    def __init__(self, world):
        size = world.size
        self.native = _C.NetComm(world.rank, size, rows.header_words(size),
                                 rows.mpi_payload_bytes(size))
        token = world.allgather(secrets.randbits(63))[0]  # rank 0's: this set-up's alone
        found = world.allgather([address(), self.native.port])
        seconds = default_timeout() or SET_UP_SECONDS
        self.native.connect([a for a, _ in found], [p for _, p in found], token, seconds)
        # a blocking call polls a moment before it sleeps (a sleep costs a wake-up), where
        # no rank of its host shares its core; the proxy, beside the caller's compute, only
        # where each has two cores
        cores = min(world.allgather(world.cores_each()))
        spin = SPIN_SECONDS if cores >= 1 else 0.0
        self.native.set_spin(spin, spin if cores >= 2 else 0.0)
        if isinstance(world, MpiWorld):
            use_native(self.native, world.coll)
        # a peer on another host that is lost or cut off closes no connection: its pulse
        # says it (torchrun's worlds; under mpiexec the job ends with it)
        self.pulses = getattr(world, "pulses", None)
        if self.pulses is not None:
            here = survivors.whoami()[0]
            self.pulses.watch(self, {r: p for r, p in enumerate(world.peers) if p[0] != here},
                              self.native.interrupt)

    def check(self, desc: list, itemsize: int, splits=None) -> None:
        self.native.check(desc, itemsize, [*splits[0], *splits[1]] if splits else [])

    def free(self) -> None:
        if self.pulses is not None:
            self.pulses.unwatch(self)
        self.native = None  # (the connections close with it)


class NetTransport(MpiTransport):
    name = "net"
    plans_agree = True  # (a fast-path plan here is agreed on first, as the general path's)

    def __init__(self, world):
        super().__init__(world)
        # MPI's own collectives (native) only where the ranks met through MPI (not torchrun's)
        self.offers = (self.offers - {"mpi"}) | world.offers
        kinds = self.fast_kinds if "mpi" in world.offers else self.fast_kinds - {"native"}
        self.fast_kinds = kinds | {"plan"}  # (its plans run in C++ as MPI's do not)

    @staticmethod
    def suits(world) -> bool:
        return world.hosts[0] > 1 and over_net()

    def make_agreement(self, world) -> Links:
        return Links(world)

    def barrier(self) -> None:  # (an exchange of rows is a barrier, checked or not)
        self.agree(descriptor("barrier", "native", 0, NONE, NONE, NONE))

    def plan(self, algo, call):
        return net_plan(algo, self.size, self.rank, call.count, call.dtype.itemsize,
                        call.params)

    def run_plan(self, plan, call) -> None:
        inp = call.inp.ptr if call.inp is not None else 0
        self.agreement.native.run_plan(plan.steps, call.out.ptr, inp, plan.tmp_bytes,
                                       call.dtype.code, call.op_code)

    def submits(self, algo, call) -> bool:
        if algo.build is not None or algo.needs == "eager":
            return True
        # MPI's own collectives too, where the world is MPI's and its datatypes and ops
        # take the call: the proxy polls them, napping, without the GIL (from Python an
        # async one's polls waited for the GIL the caller held: 66% of a 16 MiB call hidden
        # at 1 Gbit/s, where the proxy's plans hid 82%)
        return (algo.needs == "mpi" and algo.run is not None and call.splits is None
                and call.device is None and self.agreement.native.takes_native(
                    _C.COLLECTIVES[call.collective], call.dtype.code, call.op_code,
                    call.out.numel, 0 if call.inp is None else call.inp.numel))

    def submit(self, call, algo, plan, seconds: float, now: bool = False):
        native, inp = self.agreement.native, call.inp
        splits = call.split_bytes()
        mpi = plan is None and algo.needs == "mpi"  # (else eager, or a plan)
        job = (self.checks_calls and not algo.agrees, call.descriptor(algo.name),
               [*splits[0], *splits[1]] if splits else [], call.dtype.itemsize,
               None if plan is None else plan.steps, call.out.ptr, call.out.numel,
               0 if inp is None else inp.ptr, 0 if inp is None else inp.numel, call.op_code,
               0 if plan is None else plan.tmp_bytes, call.scale or 0.0, seconds, mpi)
        if now:
            return Here(lambda: native.submit(True, *job))
        return Job(native, native.submit(False, *job), (call, plan))

    def interrupt(self) -> None:
        if self.agreement.native is not None:
            self.agreement.native.interrupt()
        super().interrupt()  # (hier's parts)


def over_net(instead: str = "mpi") -> bool:
    """Whether TCP (this transport) joins the hosts, by COMMLIB_CROSS: net (the default), or
    ``instead``, what else can where the ranks met (mpi under mpiexec, gloo under torchrun)."""
    cross = settings.get("COMMLIB_CROSS")
    if cross not in ("net", instead):
        where = "MPI (mpiexec)" if instead == "mpi" else "a store (torchrun)"
        raise ValueError(f"COMMLIB_CROSS={cross!r}, but these ranks met through {where}; "
                         f"valid here: net (TCP between the hosts, the default), {instead}")
    return cross == "net"


@dataclass(frozen=True)
class Job:
    """A call handed to the proxy (NetComm.submit); ``held``: its buffers and plan, alive
    until it is done."""
    native: object
    ticket: int
    held: tuple

    def wait(self) -> tuple:
        """(started, finished) on time.monotonic's clock; raises the job's error."""
        return self.native.wait(self.ticket)

    def done(self) -> bool:
        return self.native.done(self.ticket)

    def settle(self, timeout: float | None = None) -> bool:
        """Sleep until it is done (True), or ``timeout`` seconds pass (None: no limit)."""
        return self.native.settle(self.ticket, -1.0 if timeout is None else timeout)


@dataclass(frozen=True)
class Here:
    """A job to run on the caller's thread (``submit(now=True)``): waiting for it runs it."""
    run: object

    def wait(self) -> tuple:
        return self.run()

    def done(self) -> bool:
        return False

    def settle(self, timeout: float | None = None) -> bool:
        return False


def address() -> str:
    """The IPv4 address this rank's peers reach it at (the module's header says which)."""
    wanted = settings.get("COMMLIB_SOCKET_IFNAME")
    if wanted:
        found = _interface_address(wanted)
        if found is None:
            have = [n for _, n in socket.if_nameindex() if _interface_address(n)]
            raise ValueError(f"COMMLIB_SOCKET_IFNAME={wanted!r}: no such interface with an "
                             f"IPv4 address here; these have one: {', '.join(have) or 'none'}")
        return found
    try:
        mine = socket.gethostbyname(socket.gethostname())
    except OSError:
        mine = None
    if mine and not mine.startswith("127."):
        return mine
    for _, name in socket.if_nameindex():
        found = _interface_address(name)
        if found and not found.startswith("127."):
            return found
    return "127.0.0.1"


def _interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])

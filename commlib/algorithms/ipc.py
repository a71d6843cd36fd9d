"""The GPU's own algorithms among the ranks of one host (commlib/transports/cuda_ipc.py),
all of the family "ipc", which asks for the cheapest that applies.

    oneshot   all_reduce: every rank reduces each chunk from every rank's slot
    twoshot   all_reduce: rank r reduces part r of each chunk, then gathers the others
    ipc       the other collectives, through the slots
    zerocopy  an input registered at every rank (Communicator.register): read in place

Costs count the steps through the slots (a chunk of at most a slot each: its launches and
meetings) and the bytes each rank moves through device memory per step. Two-shot's second
meeting of the ranks is priced as reading one_shot_bytes from each of the n-2 ranks beyond
a pair, so one-shot wins up to chunks of one_shot_bytes and always at 2 ranks (ties go to
the name first in order). Zero-copy takes no step through the slots.
"""
import math

from ..collectives import COLLECTIVES
from .registry import register


def _steps(nbytes, where):
    return max(1, math.ceil(nbytes / where.slot_bytes)), min(nbytes, where.slot_bytes)


def _one_shot(model, where, n, nbytes):
    steps, chunk = _steps(nbytes, where)
    return {"alpha_ipc": steps, "beta_ipc": steps * (1 + n) * chunk}


def _two_shot(model, where, n, nbytes):
    steps, chunk = _steps(nbytes, where)
    return {"alpha_ipc": steps, "beta_ipc": steps * (3 * chunk + (n - 2) * where.one_shot_bytes)}


def _through_slots(model, where, n, nbytes):
    return {"alpha_ipc": _steps(nbytes, where)[0], "beta_ipc": (1 + n) * nbytes}


def _zero_copy(model, where, n, nbytes):
    return {"beta_ipc": 2 * nbytes}


def registered(transport, call):
    """Why a call cannot go zero-copy (None: its input is registered here)."""
    buf = call.inp if call.inp is not None else call.out
    if transport is None or transport.registered.of(buf) is None:
        return "its input registered (Communicator.register) at every rank"
    return None


def _register(name, collective, cost, **fields):
    register(name, collective, cost, run=lambda t, call: t.issue(call, name), needs="cuda_ipc",
             memory="device", family="ipc", **fields)


_register("oneshot", "all_reduce", _one_shot)
_register("twoshot", "all_reduce", _two_shot)
for _collective in COLLECTIVES:
    if _collective != "all_reduce":
        _register("ipc", _collective, _through_slots)
    _register("zerocopy", _collective, _zero_copy, applies=registered)

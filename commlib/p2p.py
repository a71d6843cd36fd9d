"""send and recv of a whole tensor through the communicator's world (MPI, or a store); GPU
arrays go to a CUDA-aware MPI as they are, else through a pinned host copy."""
from __future__ import annotations

from .buffers import as_buffer
from .call import check_rank, check_timeout
from .work import Deadline


def _checked(calls, t, peer, tag, timeout, role: str, writable: bool):
    """(world, deadline, Buffer) of a message to or from ``peer``, checked."""
    calls.check_open()
    world = calls.transport.world
    deadline = Deadline(calls.timeout if timeout is None else check_timeout(timeout))
    buf = as_buffer(t, "t", writable)
    if peer is None and role == "src":
        pass  # a receive from any rank
    elif check_rank(peer, role, world.size) == world.rank:
        raise ValueError(f"{role}={peer} is this rank itself; a message to self would block "
                         "forever; copy locally instead")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= 32767:
        raise ValueError(f"tag must be an int in [0, 32767], got {tag!r}")
    return world, deadline, buf


def send(calls, t, dst, tag, async_op, timeout):
    """Send ``t`` to rank ``dst`` (``calls``: the communicator's dispatch.Dispatcher)."""
    world, deadline, buf = _checked(calls, t, dst, tag, timeout, "dst", False)
    if buf.device is not None and world.takes_device_memory:
        buf = _on_device(buf, deadline, f"send to rank {dst}")
    elif buf.device is not None:  # sent from a host copy, made once its stream gets there
        return _send_staged(calls, world, t, buf, dst, tag, async_op, deadline)
    return world.send(buf, dst, tag, deadline, async_op, t)


def recv(calls, t, src, tag, async_op, timeout):
    """Receive into ``t`` from rank ``src`` (None: any); the message must fill ``t``
    exactly."""
    world, deadline, buf = _checked(calls, t, src, tag, timeout, "src", True)
    if buf.device is not None and world.takes_device_memory:  # Work.wait() blocks
        buf = _on_device(buf, deadline, f"recv from rank {src}")
    elif buf.device is not None:  # received into a host copy; the stream copies it in after
        return _recv_staged(calls, world, t, buf, src, tag, async_op, deadline)
    return world.recv(buf, src, tag, deadline, async_op, t)


def _on_device(buf, deadline, what: str):
    """``buf``'s device memory for a CUDA-aware MPI, once its stream has done the work
    before the call (its producer, or the last reader of what a recv overwrites)."""
    from . import cuda
    from .cuda.staging import device_view, wait_event
    reached = cuda.streams().Event(buf.device.device)
    reached.record(buf.device.stream)
    wait_event(reached, deadline.seconds, what)
    return device_view(buf)


def _send_staged(calls, world, t, buf, dst, tag, async_op, deadline):
    staging = calls.staging
    staged = staging.stage_message(buf, sent=True)
    try:
        staging.copy_to_host_now(staged, deadline.seconds, f"send to rank {dst}")
        twin = staged.host["out"]  # what MPI reads: kept by the poller, not the user's array
        work = world.send(twin, dst, tag, deadline, True, twin)
    except BaseException as e:
        staging.sent(staged.block, e)
        raise
    block = staged.block
    work.add_done_callback(lambda w: staging.sent(block, w.exception()))
    if async_op:
        return work
    work.wait()
    return None


def _recv_staged(calls, world, t, buf, src, tag, async_op, deadline):
    from .cuda.staging import StagedWork
    staging = calls.staging
    staged = staging.stage_message(buf, sent=False)
    done = staging.copy_out(staged, staging.stream_for(staged.array, async_op))
    try:
        twin = staged.host["out"]  # what MPI writes: kept by the poller, not the user's array
        work = world.recv(twin, src, tag, deadline, True, twin)
    except BaseException as e:
        staging.host_part_over(staged.block, e)
        raise
    block = staged.block
    if async_op:  # nobody else would raise its error
        work.add_done_callback(lambda w: staging.host_part_over(block, w.exception()))
        return StagedWork(f"recv from rank {src}", work, done, staged.array, t, staging)
    # Blocking: the stream goes on before this returns, let go by this thread (a callback
    # may run after the caller has gone on to wait for the stream, and a thread that must
    # let the stream go may be held in a CUDA call meanwhile: a finalizer's, say)
    error = None
    try:
        work.wait()
    except BaseException as e:
        error = e
        raise
    finally:
        staging.host_part_over(block, error, remember=False)  # (raised here)
    return t

"""The torch.distributed.Works that commlib's torch backend returns.

A TorchWork wraps the commlib Works of one torch operation (a torch collective may take several
commlib calls, or none when it ran synchronously) and a *finish* step that runs once they
all completed: copying results back into non-contiguous tensors, splitting a flat buffer
into a list, folding gathered rows. Then it completes its torch Future with the output
tensors. Both happen on commlib's progress thread, so an async torch op needs nobody to
call wait() to make progress (DDP relies on that: it only chains onto the Future).
A DoneWork stands for an op that already ran to its end on plain CPU tensors.
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatchError, CommError, CommTimeoutError


# commlib's errors as torch reports backend failures: each is a DistBackendError (what
# torch users catch, as with NCCL) and still the commlib error it was.
class DistCommError(dist.DistBackendError, CommError):
    pass


class DistMismatchError(dist.DistBackendError, CollectiveMismatchError):
    pass


class DistTimeoutError(dist.DistBackendError, CommTimeoutError):
    pass


def dist_error(error: BaseException) -> BaseException:
    """``error`` as a DistBackendError if it is a commlib communication error."""
    if isinstance(error, dist.DistBackendError) or not isinstance(error, CommError):
        return error
    if isinstance(error, CommTimeoutError):  # worded as gloo's, which callers look for
        mapped = DistTimeoutError(f"commlib backend: Timed out (CommTimeoutError): {error}")
    else:
        cls = DistMismatchError if isinstance(error, CollectiveMismatchError) else DistCommError
        mapped = cls(str(error))
    mapped.__cause__ = error
    return mapped


def _seconds(timeout) -> float | None:
    """torch passes a timedelta, where zero means "no timeout"; None or seconds also work."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return None if not timeout else float(timeout)


class TorchWork(dist.Work):
    """Completes when every commlib Work in ``works`` has, then runs ``finish()``.

    ``outputs``: the tensors torch expects as the Future's value and from result(); the
    Future always gets a list (DDP's reducer indexes into it, a None crashes it).
    ``timeout``: how long wait() waits when not told (torch's "no timeout"), like gloo.
    ``keep``: staged copies of inputs the op reads, held until it completes.
    """

    def __init__(self, what: str, works: list, outputs: list, finish=None, timeout=None,
                 keep=()):
        super().__init__()
        self._what = what
        self._keep = keep  # staged inputs the op reads: alive until it completes
        self._timeout = _seconds(timeout)  # for wait() without one: the group's timeout
        self._outputs = outputs
        self._finish = finish
        self._end = None  # CUDA ops: the event after them on their stream (end_on)
        # CUDA outputs: the Future records events on the current streams when completed,
        # and its users' streams wait for them
        devices = list({t.device for t in outputs if t.is_cuda})
        self._future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending = len(works)
        self._works = works
        if not works:  # ran synchronously: finish right here, on the caller's thread
            self._complete()
        for work in works:  # a work that is already complete calls back at once
            work.add_done_callback(self._one_done)

    def __repr__(self):
        state = "failed" if self._error else "done" if self.is_completed() else "pending"
        return f"<commlib TorchWork {self._what} {state}>"

    def _one_done(self, work) -> None:
        with self._lock:
            if self._error is None and work.exception() is not None:
                self._error = dist_error(work.exception())
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        if self._error is None and self._finish is not None:
            try:
                self._finish()
            except BaseException as e:  # noqa: BLE001 - handed to wait() and the Future
                self._error = e
        self._finish = self._keep = None  # drop the staging buffers
        # The Future completes first (running its callbacks, e.g. DDP's), so that once
        # wait() returns, get_future().value() is there too.
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._outputs)
        self._done.set()

    def end_on(self, stream) -> None:
        """The op was enqueued on CUDA ``stream``: wait() and synchronize() follow it there."""
        self._end = torch.cuda.Event()
        self._end.record(stream)
        self._end_device = stream.device

    def wait(self, timeout=None) -> bool:
        if self._end is not None:  # as NCCL's: the caller's stream waits, the host goes on
            if self._error is not None:
                raise self._error
            torch.cuda.current_stream(self._end_device).wait_event(self._end)
            return True
        seconds = _seconds(timeout) or self._timeout
        if not self._done.wait(seconds):
            raise DistTimeoutError(f"commlib backend: Timed out waiting {seconds} s for "
                                   f"{self._what} to complete (a peer may not have issued it)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _source_rank(self) -> int:
        """A receive's source (torch's recv from any source asks, after wait())."""
        sources = [w.source for w in self._works if w.source is not None]
        if not sources:
            raise ValueError(f"commlib backend: {self._what} has no source rank (only a "
                             "completed receive has one)")
        return sources[0]

    def is_completed(self) -> bool:
        return self._done.is_set() and (self._end is None or self._end.query())

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error if self._done.is_set() else None

    def result(self) -> list:
        return self._outputs

    def synchronize(self) -> None:
        """Block until a CUDA op is over on its stream (CPU ops: nothing to do)."""
        if self._end is not None:
            self._end.synchronize()


class DoneWork(dist.Work):
    """A CPU op that ran to completion on the caller's thread (torch did not ask for
    async_op): nothing to wait for, so none of TorchWork's machinery; the Future is made
    only if someone asks for it."""

    def __init__(self, what: str, outputs: list):
        super().__init__()
        self._what, self._outputs = what, outputs

    def __repr__(self):
        return f"<commlib DoneWork {self._what}>"

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list:
        return self._outputs

    def synchronize(self) -> None:
        pass


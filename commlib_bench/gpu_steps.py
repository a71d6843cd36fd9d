"""GPU steps: what a meeting of the ranks costs in a call through CUDA IPC, with the host's
main thread idle and busy in Python.

    COMMLIB_CUDA_IPC_SLOT_BYTES=65536 mpiexec -n 2 commlib-bench gpu-steps [-b 64M]

- meeting: --calls all_reduces of one float in a row, the stream synchronised after each
  (one step, one meeting each): the median time per call;
- steps: an all_reduce of -b bytes, in as many steps as its slots (COMMLIB_CUDA_IPC_SLOT_BYTES,
  16 MiB by default; 64 MiB in 64 KiB slots is 1024 steps), the median over --reps of its
  time and its time per step, the main thread waiting on the stream (idle) or running a
  pure-Python loop until the call is done, asking its event between rounds of a few
  milliseconds (busy).
Each figure is the largest over the ranks. The ranks share GPU 0 (torch CUDA tensors), or,
where COMMLIB_CUDA_STREAMS plugs in the simulated GPU (tests/simulated_gpu.py), its
"device" memory.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

from commlib import settings

from .harness import parse_size

def add_arguments(p):
    p.add_argument("-b", "--bytes", type=parse_size, default=64 << 20,
                   help="the many-step all_reduce's size (default 64M)")
    p.add_argument("--calls", type=int, default=1000, help="one-step calls timed (1000)")
    p.add_argument("--reps", type=int, default=5, help="many-step calls timed per way (5)")


class HostBacked:
    """A float32 "device" array of the simulated GPU: host memory behind the CUDA interface."""

    def __init__(self, count: int):
        self.host = np.ones(count, np.float32)
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "strides": None,
                                         "data": (self.host.ctypes.data, False), "version": 3}


class Device:
    """Arrays, and the current stream's synchronisation and events, on the GPU or the
    simulated one."""

    def __init__(self):
        self.simulated = bool(settings.get("COMMLIB_CUDA_STREAMS"))
        if self.simulated:
            from commlib import cuda
            self.rt = cuda.streams()
        else:
            import torch
            self.torch = torch

    def array(self, count: int):
        if self.simulated:
            return HostBacked(count)
        return self.torch.ones(count, device="cuda")

    def synchronize(self) -> None:
        if self.simulated:
            self.rt.stream_synchronize(0, 0)
        else:
            self.torch.cuda.current_stream().synchronize()

    def event(self):
        """An event recorded on the current stream now."""
        if self.simulated:
            event = self.rt.Event(0)
            event.record(0)
            return event
        event = self.torch.cuda.Event()
        event.record()
        return event


def busy_until(event) -> None:
    """Pure Python on the main thread until ``event`` has passed: rounds of a few
    milliseconds, which let the GIL go only at the interpreter's switch interval."""
    while not event.query():
        sum(i * i for i in range(40_000))


def main(args, comm) -> int:
    world, gpu = comm.mpi, Device()
    one, big = gpu.array(1), gpu.array(args.bytes // 4)
    slot = settings.get("COMMLIB_CUDA_IPC_SLOT_BYTES")
    steps = max(1, -(-args.bytes // slot))

    def timed(fn) -> float:
        world.Barrier()
        start = time.perf_counter()
        fn()
        return world.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def one_call():
        comm.all_reduce(one)
        gpu.synchronize()

    def many_steps(busy: bool):
        comm.all_reduce(big)
        if busy:
            busy_until(gpu.event())
        gpu.synchronize()

    for _ in range(10):  # warm up: the IPC set-up, the first launches
        one_call()
    many_steps(False)
    meeting = statistics.median(timed(one_call) for _ in range(args.calls))
    idle, busy = [], []
    for _ in range(args.reps):  # interleaved
        idle.append(timed(lambda: many_steps(False)))
        busy.append(timed(lambda: many_steps(True)))
    if comm.rank == 0:
        where = "simulated GPU" if gpu.simulated else gpu.torch.cuda.get_device_name()
        print(f"# gpu-steps: {comm.size} ranks on one {where}; slots of {slot} B")
        print(f"meeting (one-step call), median of {args.calls}: {meeting * 1e6:9.1f} us")
        for name, times in (("idle", idle), ("busy", busy)):
            t = statistics.median(times)
            print(f"{args.bytes} B in {steps} steps, main thread {name}: {t * 1e3:9.2f} ms, "
                  f"{t / steps * 1e6:7.1f} us a step (median of {args.reps})")
    return 0

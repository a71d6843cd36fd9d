"""What every staged and CUDA IPC call on GPU memory rests on: a stream that waits for a
counter in pinned host memory (cuStreamWaitValue32) goes on once a host thread raises it.
tests/test_cuda.py runs each case in a process of its own, so that a stream that never goes
on fails that case instead of hanging the suite.

    python tests/cuda_counter.py CASE

  side-stream     the wait on a stream of our own; an event after it
  default-stream  the same on torch's current stream (the legacy default stream)
  torch-behind    torch's kernels (their first launch) and a copy to the host behind the wait
  queue-full      thousands of copies enqueued behind the wait: the launch queue fills and
                  enqueueing blocks, which must let the thread that raises the counter run"""
import faulthandler
import os
import sys
import threading
import time

import torch

from commlib import cuda

WAIT = 10.0  # seconds for the stream to go on once the counter is raised


def fail(message: str) -> None:
    print(f"FAIL: {message}", flush=True)
    os._exit(1)  # the stream may never go on: no teardown that would wait for it


def main(case: str) -> None:
    rt, device = cuda.streams(), 0
    torch.cuda.set_device(device)
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    counter = rt.host_alloc(64)
    rt.store_counter(counter, 0)
    stream = (rt.stream_create(device) if case == "side-stream"
              else torch.cuda.current_stream().cuda_stream)
    rt.wait_value(stream, device, counter, 1)
    raised = threading.Event()

    def raise_counter():
        time.sleep(0.2)
        rt.store_counter(counter, 1)
        raised.set()
    threading.Thread(target=raise_counter, daemon=True).start()
    start = time.monotonic()
    if case in ("side-stream", "default-stream"):
        passed = rt.Event(device)
        passed.record(stream)
        while not passed.query():
            if time.monotonic() - start > WAIT:
                fail(f"the stream did not go on within {WAIT:g} s of the counter's raise")
            time.sleep(1e-3)
    elif case == "torch-behind":
        got = (x * 3).double().cpu()
        if not torch.equal(got, torch.arange(1 << 20, dtype=torch.float64) * 3):
            fail("wrong values behind the wait")
    elif case == "queue-full":
        y = torch.empty_like(x)
        for _ in range(20000):  # more than a launch queue holds
            rt.copy_async(y.data_ptr(), x.data_ptr(), 1024, device, stream)
        torch.cuda.synchronize()
    else:
        fail(f"unknown case {case!r}")
    if not raised.is_set():
        fail("the stream went on before the counter was raised")
    print(f"{case}: the stream went on {time.monotonic() - start:.3f} s after the wait was "
          "enqueued (the counter was raised at 0.2 s)", flush=True)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(2 * WAIT, exit=True, file=sys.stdout)  # where a hang stood
    main(sys.argv[1])

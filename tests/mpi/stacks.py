"""COMMLIB_TEST_STACKS=SECONDS: a rank still running after that long prints every thread's
stack and exits (.ci/gpu sets it, so that a hang on a lent GPU says where each rank stood).
Python's stacks come from faulthandler; some seconds before, where gdb (or cuda-gdb, as on
the GPU machines) is installed, it prints the native ones too: which thread is inside which
CUDA or torch call, and so which one holds the GIL (Python's stacks cannot tell)."""
import faulthandler
import os
import shutil
import subprocess

NATIVE_LEAD = 10.0  # seconds before Python's stacks: attaching can take cuda-gdb a while

_watcher = None  # the process that runs the debugger when the time comes


def arm() -> None:
    global _watcher
    disarm()  # (a pool's job imports harness, which arms too)
    seconds = float(os.environ.get("COMMLIB_TEST_STACKS") or 0)
    if not seconds:
        return
    faulthandler.dump_traceback_later(seconds, exit=True)
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger:
        wait = max(1.0, seconds - NATIVE_LEAD)
        _watcher = subprocess.Popen(
            ["sh", "-c", f'sleep {wait}; echo "native stacks of pid {os.getpid()}:"; '
             f'exec "$0" -q -p {os.getpid()} -batch -ex "thread apply all bt"', debugger],
            stdin=subprocess.DEVNULL)


def disarm() -> None:
    global _watcher
    faulthandler.cancel_dump_traceback_later()
    if _watcher is not None:
        _watcher.kill()
        _watcher.wait()
        _watcher = None

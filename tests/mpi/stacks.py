"""COMMLIB_TEST_STACKS=SECONDS: a rank still running after that long reports where it stands
and exits (.ci/gpu sets it, so that a hang on a lent GPU says where each rank stood); with
COMMLIB_TEST_CASE_SECONDS the harness re-arms it for each case of a script.
The report goes to stderr, or with COMMLIB_TEST_STACKS_DIR to hang-r<RANK>.txt there (a
file per rank, appended to: a lent GPU's call returns only a few files):
- some seconds before the end, each GPU proxy's heartbeat (plan, step, meeting, what it
  waits for and since when, its counters: commlib/transports/cuda_ipc.py), where a Python
  thread can still run;
- then every thread's native stack where gdb (or cuda-gdb) may attach: which thread is
  inside which CUDA or torch call, and so which one holds the GIL (Python's stacks cannot
  tell); where it may not, each thread's name and kernel wait channel (/proc/PID/task);
- last, every thread's Python stack (faulthandler, which needs no GIL)."""
import atexit
import faulthandler
import gc
import os
import shutil
import subprocess
import sys
import threading

NATIVE_LEAD = 10.0  # seconds before Python's stacks: attaching can take cuda-gdb a while
HEARTBEAT_LEAD = 2.0  # seconds before the native stacks (at most)

_watcher = None  # the process that runs the debugger when the time comes
_timer = None
_report = None


def _rank() -> str:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        if name in os.environ:
            return os.environ[name]
    return f"pid{os.getpid()}"


def _heartbeats(report, case: str) -> None:
    """Every live GPU proxy's heartbeat (found by type: nothing registers them)."""
    print(f"rank {_rank()} in {case}, near its limit", file=report, flush=True)
    from commlib.transports.cuda_ipc import CudaIpc
    for gpu in [o for o in gc.get_objects() if isinstance(o, CudaIpc)]:
        print(f"rank {_rank()} GPU proxy on device {gpu.device} (steps issued {gpu.step}): "
              f"{gpu.heartbeat()}", file=report, flush=True)


def arm(seconds: float | None = None, case: str = "the script") -> None:
    """Report and exit after ``seconds`` (COMMLIB_TEST_STACKS's, by default) from now."""
    global _watcher, _timer, _report
    disarm()  # (a pool's job imports harness, which arms too)
    seconds = seconds or float(os.environ.get("COMMLIB_TEST_STACKS") or 0)
    if not seconds:
        return
    where = os.environ.get("COMMLIB_TEST_STACKS_DIR")
    path = os.path.join(where, f"hang-r{_rank()}.txt") if where else None
    _report = _report if _report is not None else open(path, "a") if path else sys.stderr
    faulthandler.dump_traceback_later(seconds, exit=True, file=_report)
    native_lead = min(NATIVE_LEAD, seconds / 3)  # (a short limit: its last third)
    beat_lead = native_lead + min(HEARTBEAT_LEAD, seconds / 10)
    _timer = threading.Timer(seconds - beat_lead, _heartbeats, (_report, case))
    _timer.daemon = True
    _timer.start()
    pid, wait = os.getpid(), seconds - native_lead
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    native = (f'"{debugger}" -q -p {pid} -batch -ex "thread apply all bt" 2>&1' if debugger
              else "true")
    channels = (f'for t in /proc/{pid}/task/*; do echo "$t $(cat $t/comm) $(cat $t/wchan)"; '
                'done')
    _watcher = subprocess.Popen(  # (nothing, should the rank have gone meanwhile)
        ["sh", "-c", f'sleep {wait}; kill -0 {pid} || exit; echo "native stacks of pid {pid} '
         f'(rank {_rank()}):"; out=$({native}); case "$out" in *"#0 "*) echo "$out";; '
         f'*) {channels};; esac'],
        stdin=subprocess.DEVNULL, stdout=_report if path else None, stderr=subprocess.STDOUT)


def disarm() -> None:
    global _watcher, _timer
    faulthandler.cancel_dump_traceback_later()
    if _timer is not None:
        _timer.cancel()
        _timer = None
    if _watcher is not None:
        _watcher.kill()
        _watcher.wait()
        _watcher = None


@atexit.register
def _at_exit() -> None:
    """No watcher outlives the rank, and no empty report is left."""
    disarm()
    if _report is not None and _report is not sys.stderr:
        _report.close()
        if os.path.getsize(_report.name) == 0:
            os.remove(_report.name)

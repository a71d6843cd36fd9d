"""A host that forbids process_vm_readv or process_vm_writev (as Docker's default seccomp
profile does): every rank installs a seccomp filter that fails the system call with EPERM
before commlib starts. The one-copy collectives must be off, set-up must say why, asking
for them must raise naming the cause, and auto must still give right results.

Usage: mpiexec -n N python tests/mpi/one_copy_forbidden.py process_vm_readv|process_vm_writev
"""
import ctypes
import platform
import sys
import warnings

import numpy as np

from harness import Checker, assert_equal, raises

FORBIDDEN = sys.argv[1]
NUMBER = {"process_vm_readv": {"x86_64": 310, "aarch64": 270},
          "process_vm_writev": {"x86_64": 311, "aarch64": 271}}[FORBIDDEN][platform.machine()]


def forbid() -> None:
    """Make FORBIDDEN fail with EPERM in this process (seccomp, needs no root)."""
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    load_nr, jump_if_equal, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    errno_eperm, allow = 0x00050000 | 1, 0x7FFF0000
    program = (Filter * 4)(Filter(load_nr, 0, 0, 0),  # seccomp_data.nr
                           Filter(jump_if_equal, 0, 1, NUMBER),
                           Filter(ret, 0, 0, errno_eperm), Filter(ret, 0, 0, allow))
    libc = ctypes.CDLL(None, use_errno=True)
    no_new_privs, set_seccomp, mode_filter = 38, 22, 2
    if libc.prctl(no_new_privs, 1, 0, 0, 0) or libc.prctl(
            set_seccomp, mode_filter, ctypes.byref(Program(4, program)), 0, 0):
        raise OSError(ctypes.get_errno(), "prctl")


forbid()
import commlib  # noqa: E402

with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()


def says_why_and_falls_back():
    assert comm.transport == "shm"
    assert "one_copy" not in comm.algorithms("all_gather")
    if rank == 0:
        text = " ".join(str(w.message) for w in said)
        assert "one-copy collectives are off" in text and "Operation not permitted" in text \
            and "seccomp" in text, text
    raises(ValueError, FORBIDDEN,
           lambda: comm.all_gather(np.zeros(2 * n), np.zeros(2), algorithm="one_copy"))
    for count in (7, 1 << 18):  # auto, small and large
        out = np.zeros(n * count)
        comm.all_gather(out, np.full(count, float(rank)))
        assert_equal(out, np.repeat(np.arange(n, dtype=float), count))
        t = np.full(count, rank + 1.0)
        comm.all_reduce(t)
        assert_equal(t, np.full(count, n * (n + 1) / 2))


check.check("one-copy forbidden", says_why_and_falls_back)
check.finish()

"""one_copy: host-only collectives that read the peers' buffers where they lie with
process_vm_readv (csrc/shm_one_copy.cpp; broadcast's root meanwhile writes a share of
each reader's with process_vm_writev): one copy per byte where direct makes two, but
a system call per read and the kernel pinning the pages. Pinning 4 KiB pages costs more
than staging their bytes, so where a rank's buffer lies mostly on them the call stages
as direct does (each rank looks at its own pages; all see the same verdict). Which wins
depends on the machine and the memory; self-tuning compares them on 4 KiB pages
(commlib/tuning.py).
"""
from .registry import register

# (meetings, bytes copied, bytes reduced) per rank for N primary bytes among n ranks
FORMULAS = {
    # each rank's block reduced from every peer's, then the other blocks read
    "all_reduce": lambda n, N: (3, 2 * (n - 1) / n * N, N),
    "reduce_scatter": lambda n, N: (2, (n - 1) * N, n * N),
    "all_gather": lambda n, N: (2, n * N, 0),
    "broadcast": lambda n, N: (2, (n - 1) / n * N, 0),  # (the root copies a share too)
    "all_to_all": lambda n, N: (2, N, 0),
}


def terms(collective, n, nbytes) -> dict:
    meetings, copied, reduced = FORMULAS[collective](n, nbytes)
    return {"alpha_shm": meetings, "beta_one_copy": copied, "gamma_shm": reduced}


def run(transport, call):
    transport.one_copy(call)


for _collective in FORMULAS:
    register("one_copy", _collective, lambda model, where, n, nbytes, c=_collective:
             terms(c, n, nbytes), run=run, needs="one_copy", agrees=True,
             rank_order=True)

"""commlib's microbenchmarks: ``mpiexec -n 2 python -m commlib_bench <command>`` (see __main__).

Each rank is meant to own one core: math libraries must not start thread pools of their own
(set before numpy loads, which is why it lives here)."""
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

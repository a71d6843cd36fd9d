"""commlib's microbenchmarks: ``mpiexec -n 2 python -m bench <command>`` (see __main__)."""

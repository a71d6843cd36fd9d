"""Executors run schedules: ``python`` over mpi4py non-blocking point-to-point."""

"""Compressed collectives on GPU arrays (commlib/compressed_device.py) beside the same calls
on CPU arrays (commlib/compressed.py, itself checked against numpy by compressed.py here):
equal bit for bit, residuals too, step after step, every format, pieces, sum and avg; a GPU
rank among CPU ranks; feedback saved and restored on the way; errors.

On a GPU the arrays are torch CUDA tensors; on the simulated GPU (COMMLIB_CUDA_STREAMS,
tests/simulated_gpu.py) host arrays behind a __cuda_array_interface__, the kernels
commlib/cuda/wire.cu compiled for the CPU.

Usage: mpiexec -n N python tests/mpi/compressed_gpu.py   (N = 1..4)
"""

import numpy as np

import commlib
from commlib import compressed, settings
from harness import Checker, raises
from tests.simulated_gpu import HostArray

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()
SIMULATED = bool(settings.get("COMMLIB_CUDA_STREAMS"))
FORMATS = ["bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"]


def device(values: np.ndarray):
    if SIMULATED:
        return HostArray(np.array(values, np.float32))
    import torch
    return torch.from_numpy(np.array(values, np.float32)).cuda()


def host(x) -> np.ndarray:
    return np.array(x.host) if SIMULATED else x.cpu().numpy()


def data(r: int, count: int, step: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * r + 17 * step + count)
    return (rng.standard_normal(count) * np.exp(rng.uniform(-3, 3, count))).astype(np.float32)


def same_state(a: compressed.ErrorFeedback, b: compressed.ErrorFeedback, what):
    for name, x in a.state_dict().items():
        y = b.state_dict()[name]
        assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), (what, name)


def all_reduce_as_on_the_cpu():
    for fmt in FORMATS:
        for op, piece in (("sum", compressed.PIECE), ("avg", 300)):  # (4 pieces of 1001)
            on_cpu, on_gpu = compressed.ErrorFeedback(), compressed.ErrorFeedback()
            for step in range(3):
                x = data(rank, 1001, step)
                want = compressed.all_reduce(comm, x.copy(), fmt, on_cpu, op, piece)
                got = device(x)
                assert compressed.all_reduce(comm, got, fmt, on_gpu, op, piece) is got
                assert np.array_equal(host(got), want), (fmt, op, step)
            same_state(on_cpu, on_gpu, fmt)


def without_feedback_and_fewer_elements_than_ranks():
    x = data(rank, 3)
    got = device(x)
    compressed.all_reduce(comm, got, compressed.Wire("int8", 32))
    assert np.array_equal(host(got), compressed.all_reduce(comm, x, compressed.Wire("int8", 32)))


def reduce_scatter_and_all_gather_as_on_the_cpu():
    count = 77
    for fmt in FORMATS:
        on_cpu, on_gpu = compressed.ErrorFeedback(), compressed.ErrorFeedback()
        for step in range(2):
            x = data(rank, n * count, step)
            want = np.empty(count, np.float32)
            compressed.reduce_scatter(comm, want, x, fmt, on_cpu, op="avg")
            got = device(np.zeros(count))
            compressed.reduce_scatter(comm, got, device(x), fmt, on_gpu, op="avg")
            assert np.array_equal(host(got), want), (fmt, step)
        same_state(on_cpu, on_gpu, fmt)
        on_cpu, on_gpu = compressed.ErrorFeedback(), compressed.ErrorFeedback()
        for step in range(2):
            x = data(rank, count, step)
            want = np.empty(n * count, np.float32)
            compressed.all_gather(comm, want, x, fmt, on_cpu)
            got = device(np.zeros(n * count))
            compressed.all_gather(comm, got, device(x), fmt, on_gpu)
            assert np.array_equal(host(got), want), (fmt, step)
        same_state(on_cpu, on_gpu, fmt)


def a_gpu_rank_among_cpu_ranks():
    """Rank 0's data on the device, the others' on the host: the packets are the same
    bits, so the results are those of the all-CPU call."""
    x = data(rank, 500)
    want = compressed.all_reduce(comm, x.copy(), "fp8_e4m3", compressed.ErrorFeedback())
    mine = device(x) if rank == 0 else x.copy()
    compressed.all_reduce(comm, mine, "fp8_e4m3", compressed.ErrorFeedback())
    assert np.array_equal(host(mine) if rank == 0 else mine, want)


def feedback_saved_on_the_gpu_goes_on_anywhere():
    """A device residual's state_dict is host memory; loaded, the next call goes on where
    it stopped, on the device or on the host."""
    kept = compressed.ErrorFeedback()
    for step in range(2):
        compressed.all_reduce(comm, device(data(rank, 400, step)), "int8", kept)
    saved = kept.state_dict()
    assert n == 1 or isinstance(saved["worker"], np.ndarray)
    on_cpu, on_gpu = compressed.ErrorFeedback(), compressed.ErrorFeedback()
    on_cpu.load_state_dict(saved), on_gpu.load_state_dict(saved)
    x = data(rank, 400, 2)
    want = compressed.all_reduce(comm, x.copy(), "int8", on_cpu)
    got = device(x)
    compressed.all_reduce(comm, got, "int8", on_gpu)
    assert np.array_equal(host(got), want)
    # and the device's residual, back on the host, carries on there
    again = compressed.all_reduce(comm, data(rank, 400, 3), "int8", on_gpu)
    assert np.array_equal(again, compressed.all_reduce(comm, data(rank, 400, 3), "int8", on_cpu))


def bad_input_says_what_and_how():
    raises(TypeError, "takes float32 data, not int32", lambda: compressed.all_reduce(
        comm, HostArray(np.ones(8, np.int32)) if SIMULATED else device(np.ones(8)).int(),
        "int8"))
    raises(ValueError, f"input has 10 elements, needs {n} x the output's 11",
           lambda: compressed.reduce_scatter(comm, device(np.ones(11)), device(np.ones(10)),
                                             "int8"))
    raises(ValueError, "op 'max' cannot be compressed",
           lambda: compressed.all_reduce(comm, device(np.ones(4)), "int8", op="max"))
    if n > 1:
        feedback = compressed.ErrorFeedback()
        compressed.all_reduce(comm, device(np.ones(10)), "int8", feedback)
        raises(ValueError, "one ErrorFeedback per tensor",
               lambda: compressed.all_reduce(comm, device(np.ones(12)), "int8", feedback))


check.run_cases(globals())

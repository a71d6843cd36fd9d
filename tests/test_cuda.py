"""The GPU path's kernels (commlib/cuda). Tests marked gpu need a CUDA device and are
skipped without one; the rest check, on any machine, what can be checked without one: the
build, the NVRTC compile of the same source, and the errors for arrays that are not on a GPU."""
import ctypes
import glob
import os
import re
import shutil

import numpy as np
import pytest

import commlib
from commlib import cuda
from mpirun import run_checked

HAS_GPU = cuda.device_count() > 0
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device visible (cuda.device_count() == 0)")


def test_build_info_says_what_was_compiled():
    info = commlib.build_info()
    if shutil.which("nvcc") and os.environ.get("COMMLIB_CUDA") != "0":
        # setup.py found nvcc, so the kernels must have been compiled, not silently skipped
        assert info["cuda"] is True and info["compiled_by"] == "nvcc"
        assert re.fullmatch(r"\d+\.\d+", info["cuda_version"]) and "sm_90" in info["nvcc_flags"]
    else:
        assert info["compiled_by"] in (None, "nvrtc (cupy, at first use)")


def test_every_kernel_the_launchers_name_is_defined():
    src = cuda.source()
    defined = set(re.findall(r"^COMMLIB_DTYPE\((\w+),", src, re.M))
    assert defined == {"f16", "bf16", "f32", "f64", "i8", "u8", "i32", "i64"}
    for op in ("sum", "prod", "min", "max"):
        assert f"COMMLIB_REDUCE(name, T, {op}," in src
        assert f"COMMLIB_REDUCE_N(name, T, {op}," in src
    assert set(re.findall(r"^COMMLIB_CASTS_FROM\((\w+),", src, re.M)) == {"f16", "bf16", "f32", "f64"}


def _libnvrtc():
    try:
        import nvidia.cu13  # the nvidia-cuda-nvrtc wheel (test extra)
        found = glob.glob(os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so*"))
    except ImportError:
        found = glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    return ctypes.CDLL(found[0]) if found else None


@pytest.mark.skipif(_libnvrtc() is None, reason="libnvrtc not installed (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ["75", "90"])
def test_kernels_compile_with_nvrtc(arch):
    """What an install without nvcc does at run time (runtime.py, through CuPy's NVRTC)."""
    nvrtc, prog = _libnvrtc(), ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), cuda.source().encode(), b"kernels.cu",
                                    0, None, None) == 0
    opts = [b"-std=c++17", f"--gpu-architecture=compute_{arch}".encode()]
    status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert status == 0, log.value.decode()
    ptx_size = ctypes.c_size_t()
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
    ptx = ctypes.create_string_buffer(ptx_size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    for name in ("commlib_reduce_bf16_max", "commlib_reduce_n_i8_prod", "commlib_cast_f32_f16",
                 "commlib_copy"):
        assert f".entry {name}(" in ptx.value.decode()
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def test_host_arrays_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="not a CUDA array"):
        cuda.reduce(np.zeros(4), np.zeros(4), np.zeros(4))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"CPU tensor.*\.cuda\(\)"):
        cuda.copy(torch.zeros(4), torch.zeros(4))


@pytest.mark.skipif(HAS_GPU or cuda.build_info()["compiled_by"] != "nvcc",
                    reason="checks the nvcc-built kernels on a machine without a GPU")
def test_launch_without_a_device_raises():
    with pytest.raises(RuntimeError):
        cuda.kernels().reduce(0, 0, 0, 16, 2, 0, 0, 0)


# --- on a GPU ----------------------------------------------------------------------------

def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


REFERENCE = {"sum": lambda a, b: a + b, "prod": lambda a, b: a * b, "avg": lambda a, b: a + b,
             "min": lambda a, b: __import__("torch").minimum(a, b),
             "max": lambda a, b: __import__("torch").maximum(a, b)}


@gpu
@pytest.mark.parametrize("dtype", cuda.DTYPES)
@pytest.mark.parametrize("op", cuda.OPS)
@pytest.mark.parametrize("count,offset", [(1, 0), (1000, 0), (4099, 1), (1 << 20, 0)])
def test_reduce_matches_torch(dtype, op, count, offset):
    torch = _torch_cuda()
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(count + offset)
    make = (lambda: torch.randint(-100, 100, (count + offset,), device="cuda", generator=g).to(dt)
            if not dt.is_floating_point else
            torch.randn(count + offset, device="cuda", generator=g).to(dt))
    a, b = make()[offset:], make()[offset:]  # offset 1: not 16-byte aligned
    if dt.is_floating_point:
        a[:3] = torch.tensor([float("nan"), 1.0, float("inf")])
    out = torch.empty_like(a)
    cuda.reduce(out, a, b, op)
    compute = torch.float32 if dtype in ("float16", "bfloat16") else dt
    want = REFERENCE[op](a.to(compute), b.to(compute)).to(dt)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@gpu
@pytest.mark.parametrize("src", cuda.FLOATING)
@pytest.mark.parametrize("dst", cuda.FLOATING)
def test_cast_and_scale_match_torch(src, dst):
    torch = _torch_cuda()
    x = (torch.randn(5003, device="cuda", dtype=torch.float64) * 1e3).to(getattr(torch, src))
    y = torch.empty(5003, device="cuda", dtype=getattr(torch, dst))
    cuda.cast(y, x)
    torch.testing.assert_close(y, x.to(torch.float32).to(y.dtype) if src == "float64"
                               and dst in ("float16", "bfloat16") else x.to(y.dtype), rtol=0, atol=0)
    z = x.clone()
    cuda.scale(z, 0.25)
    torch.testing.assert_close(z, x * 0.25, rtol=0, atol=0)


@gpu
def test_copy_and_stream_order():
    torch = _torch_cuda()
    side = torch.cuda.Stream()
    src = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
    dst = torch.zeros_like(src)
    with torch.cuda.stream(side):
        src.mul_(2)  # enqueued before the copy on the same stream
        cuda.copy(dst, src)
    side.synchronize()
    torch.testing.assert_close(dst, torch.arange(1 << 22, device="cuda", dtype=torch.float32) * 2)


@gpu
def test_runtime_compiled_kernels_agree_with_nvcc_built_ones():
    torch = _torch_cuda()
    pytest.importorskip("cupy")
    from commlib.cuda.runtime import CupyRuntime
    nvrtc = CupyRuntime()
    a = torch.randn(10007, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(10007, device="cuda", dtype=torch.bfloat16)
    out, want = torch.empty_like(a), torch.empty_like(a)
    stream = torch.cuda.current_stream().cuda_stream
    nvrtc.reduce(out.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel(), 1, 0, 0, stream)
    cuda.reduce(want, a, b, "sum")
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@gpu
def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(1000, dtype=cupy.float32)
    out = cupy.empty_like(a)
    cuda.reduce(out, a, a, "max")
    cupy.cuda.get_current_stream().synchronize()
    assert bool((out == a).all())


SIMULATED = {"COMMLIB_CUDA_SIMULATE": "1"}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_calls_on_gpu_memory_on_a_simulated_gpu(n):
    """The staged and IPC calls' ordering (cuda/staging.py, cuda/ipc.py): results, stream
    order, async Works, failures releasing the stream, with "device" arrays in host memory,
    streams run by threads and IPC memory in POSIX shared memory (cuda/simulator.py).
    Whether CUDA does the same is for the GPU tests below."""
    run_checked(n, "tests/mpi/cuda_staged.py", env=SIMULATED)


@pytest.mark.parametrize("n", [3, 4])
def test_ipc_all_reduce_in_many_two_shot_steps_on_a_simulated_gpu(n):
    """4 KiB slots: a call takes many steps, each reduced in two shots."""
    run_checked(n, "tests/mpi/cuda_staged.py", env={
        **SIMULATED, "COMMLIB_CUDA_IPC_SLOT_BYTES": "4096", "COMMLIB_CUDA_IPC_ONE_SHOT_BYTES": "0"})


def test_staged_all_reduce_on_a_simulated_gpu():
    """COMMLIB_CUDA_IPC=0: all_reduce staged through host memory like the others."""
    run_checked(3, "tests/mpi/cuda_staged.py", env={**SIMULATED, "COMMLIB_CUDA_IPC": "0"})


def test_send_and_recv_through_a_cuda_aware_mpi_on_a_simulated_gpu():
    """COMMLIB_CUDA_AWARE_MPI=1: send and recv hand MPI device pointers (host memory on the
    simulated GPU) once the stream has done the work before them."""
    run_checked(2, "tests/mpi/cuda_staged.py", env={**SIMULATED, "COMMLIB_CUDA_AWARE_MPI": "1"})


def test_calls_on_gpu_memory_on_a_simulated_gpu_over_mpi():
    """As between hosts: the twins go through the mpi4py executor."""
    run_checked(3, "tests/mpi/cuda_staged.py", env={**SIMULATED, "COMMLIB_TRANSPORT": "mpi"})


@gpu
@pytest.mark.parametrize("n,env", [(1, {}), (2, {}), (3, {}),
                                   (3, {"COMMLIB_CUDA_IPC_SLOT_BYTES": "4096",
                                        "COMMLIB_CUDA_IPC_ONE_SHOT_BYTES": "0"}),
                                   (2, {"COMMLIB_CUDA_IPC": "0"})], ids=str)
def test_calls_on_gpu_memory(n, env):
    """torch CUDA tensors; the ranks share device 0."""
    pytest.importorskip("torch")
    run_checked(n, "tests/mpi/cuda_staged.py", env=env)


@gpu
def test_calls_on_gpu_memory_through_cupy():
    """COMMLIB_CUDA_RUNTIME=cupy: the staged and IPC calls through CuPy's bindings, as an
    install built without nvcc makes them."""
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    run_checked(3, "tests/mpi/cuda_staged.py", env={"COMMLIB_CUDA_RUNTIME": "cupy"})


@gpu
@pytest.mark.parametrize("script,n", [("basics", 3), ("train", 2), ("train", 3), ("tp", 2),
                                      ("tp", 4), ("pp", 2), ("pp", 4), ("sp", 2), ("sp", 4),
                                      ("moe", 4)], ids=str)
def test_strategies_match_one_process_on_cuda(script, n):
    """The strategies' equivalence scripts (mappings, DP and ZeRO-1/2/3, TP, PP, SP, MoE and
    their combinations) with their models and data on GPU 0, which the ranks share."""
    pytest.importorskip("torch")
    run_checked(n, f"tests/mpi/strategies_{script}.py", env={"COMMLIB_TEST_DEVICE": "cuda"})

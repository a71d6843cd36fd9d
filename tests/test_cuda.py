"""The GPU path's kernels (commlib/cuda). Tests marked gpu need a CUDA device and are
skipped without one; the rest check, on any machine, what can be checked without one: the
build, the NVRTC compile of the same source, the kernels' code compiled for the CPU
(cuda_on_host), the errors for arrays that are not on a GPU, and the collectives' ordering
on a simulated GPU."""
import ast
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import commlib
import simulated_gpu
from commlib import cuda, settings
from mpirun import mpirun, run_checked, sizes

HAS_GPU = cuda.device_count() > 0
gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA device visible (cuda.device_count() == 0)")


def test_build_info_says_what_was_compiled():
    info = commlib.build_info()
    if shutil.which("nvcc") and settings.get("COMMLIB_CUDA"):
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
    assert (set(re.findall(r"^COMMLIB_CASTS_FROM\((\w+),", src, re.M))
            == {"f16", "bf16", "f32", "f64"})


def test_the_most_pointers_a_kernel_takes_agree_in_python_cuda_and_the_proxy():
    proxy = (Path(__file__).resolve().parents[1] / "csrc" / "gpu_proxy.h").read_text()
    said = {"kernels.cu": int(re.search(r"kMaxPointers = (\d+);", cuda.source())[1]),
            "gpu_proxy.h": int(re.search(r"kMaxRanks = (\d+);", proxy)[1])}
    assert said == dict.fromkeys(said, cuda.MAX_POINTERS)


def _calls(path: Path, cls: str) -> dict:
    """{method: its parameter names} of class cls in path, read without importing it (the
    CuPy runtime's module needs CuPy)."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {f.name: [a.arg for a in f.args.args if a.arg != "self"]
            for f in body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


@pytest.mark.skipif(cuda.build_info()["compiled_by"] != "nvcc", reason="built without nvcc")
def test_the_other_runtimes_take_the_nvcc_builds_calls_alike():
    """runtime.py (CuPy) offers every call of commlib._cuda, and the simulator the ones it
    has, with the same parameters: the callers pass them by position."""
    from commlib import _cuda
    built = {name: re.findall(r"(\w+):", getattr(_cuda, name).__doc__.split("->")[0])
             for name in dir(_cuda) if callable(getattr(_cuda, name)) and name[0] != "_"
             and name != "Event"}
    here = Path(cuda.__file__).parent
    cupy = _calls(here / "runtime.py", "CupyRuntime")
    assert {name: cupy.get(name) for name in built} == built
    simulator = Path(simulated_gpu.__file__)
    simulated = {name: args for name, args in _calls(simulator, "SimulatedDevice").items()
                 if name in built}
    assert {name: built[name] for name in simulated} == simulated and len(simulated) > 15
    assert _calls(here / "runtime.py", "Event") == _calls(simulator, "_Event") == \
        {"record": ["stream"], "query": [], "wait": ["stream"], "synchronize": []}


# bindings of csrc/cuda that keep the GIL, and why that is safe: they make no CUDA call
KEEP_THE_GIL = {"store_counter": "a store to pinned host memory"}
CUDA_CALL = re.compile(r"\b(?:cuda|cu)[A-Z]\w*\s*\(|\blaunch\w*\(|\bOnDevice\b|&\w+::\w+")


def _bindings(source: str):
    """(name, text) of every binding a csrc/cuda unit defines: from its .def( to the next."""
    found = [(m.start(), m.group(1) or "__init__")
             for m in re.finditer(r'\.def\(\s*(?:"(\w+)"|py::init)', source)]
    for (at, name), (end, _) in zip(found, found[1:] + [(len(source), None)]):
        yield name, source[at:end]


def _outside_without_gil(text: str) -> str:
    """``text`` less every without_gil(...) call in it."""
    while (at := text.find("without_gil(")) >= 0:
        depth, end = 0, at + len("without_gil")
        for end in range(end, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        text = text[:at] + text[end + 1:]
    return text


def test_no_binding_holds_the_gil_across_a_cuda_call():
    """A CUDA call can block (a full launch queue, lazy loading, a driver lock held by a
    thread waiting on a stream). One made with the GIL held stalls every Python thread
    behind it, and so whatever the stream waits for: every binding of csrc/cuda lets the
    GIL go around its CUDA calls (WithoutGil, or without_gil(...) where it builds Python
    objects after), but those KEEP_THE_GIL names, which make none."""
    root = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
    seen = set()
    for unit in sorted(root.glob("*.cu")):
        for name, text in _bindings(unit.read_text()):
            seen.add(name)
            if name in KEEP_THE_GIL:
                assert not CUDA_CALL.search(text), f"{unit.name}: {name} calls CUDA"
            elif "WithoutGil()" not in text:
                assert "without_gil(" in text, f"{unit.name}: {name} holds the GIL"
                call = CUDA_CALL.search(_outside_without_gil(text))
                assert call is None, f"{unit.name}: {name} calls {call[0]} with the GIL held"
    assert {"ipc_handle", "ipc_open", "device_uuid", "address_range", "copy_async", "__init__",
            "record", "query", "write_value"} <= seen and set(KEEP_THE_GIL) <= seen


def _libnvrtc():
    try:
        import nvidia.cu13  # the nvidia-cuda-nvrtc wheel (test extra)
        found = glob.glob(os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so*"))
    except ImportError:
        found = glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    return ctypes.CDLL(found[0]) if found else None


@pytest.mark.skipif(_libnvrtc() is None,
                    reason="libnvrtc not installed (pip install nvidia-cuda-nvrtc)")
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
    wire = [f"commlib_wire_{kind}_{fmt}" for kind in ("encode", "decode_sum", "sum_encode")
            for fmt in cuda.WIRE_FORMATS]
    for name in ("commlib_reduce_bf16_max", "commlib_reduce_n_i8_prod", "commlib_cast_f32_f16",
                 "commlib_copy", *wire):
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


# --- the kernels, on a GPU and emulated on the CPU -------------------------------------------

def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch


class Kernels:
    """The kernels on torch tensors of one target: a GPU (the public calls, and reduce_n
    as the IPC collectives launch it), or kernels.cu compiled for the CPU (cuda_on_host)."""

    def __init__(self, device: str, host=None):
        self.device, self.host = device, host

    def reduce(self, out, a, b, op):
        if self.host is None:
            return cuda.reduce(out, a, b, op)
        self.host.reduce(out.data_ptr(), a.data_ptr(), b.data_ptr(), out.numel(), _code(out),
                         cuda.OPS.index(op))

    def reduce_n(self, targets, sources, op):
        args = ([x.data_ptr() for x in targets], [x.data_ptr() for x in sources],
                sources[0].numel(), _code(sources[0]), cuda.OPS.index(op))
        if self.host is not None:
            return self.host.reduce_n(*args)
        stream = __import__("torch").cuda.current_stream().cuda_stream
        cuda.kernels().reduce_n(*args, sources[0].device.index, stream)

    def cast(self, dst, src):
        if self.host is None:
            return cuda.cast(dst, src)
        self.host.cast(dst.data_ptr(), src.data_ptr(), dst.numel(), _code(src), _code(dst))

    def scale(self, x, factor):
        if self.host is None:
            return cuda.scale(x, factor)
        self.host.scale(x.data_ptr(), factor, x.numel(), _code(x))

    def copy(self, dst, src):
        if self.host is None:
            return cuda.copy(dst, src)
        self.host.copy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())

    def synchronize(self):
        if self.host is None:
            __import__("torch").cuda.synchronize()

    def wire(self, name, *args):
        """wire.cu's kernel ``name`` (wire_encode, wire_decode_sum, wire_sum_encode) on
        addresses, with the arguments commlib._cuda's calls take before device and stream."""
        if self.host is not None:
            return getattr(self.host, name)(*args)
        torch = __import__("torch")
        getattr(cuda.kernels(), name)(*args, torch.cuda.current_device(),
                                      torch.cuda.current_stream().cuda_stream)


def _code(x) -> int:
    return cuda.DTYPES.index(str(x.dtype).removeprefix("torch."))


@pytest.fixture(scope="session")
def host_kernels(tmp_path_factory):
    import cuda_on_host
    if cuda_on_host.compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX) to build kernels.cu for the CPU")
    return cuda_on_host.HostKernels(cuda_on_host.build(tmp_path_factory.mktemp("cuda_on_host")))


@pytest.fixture(params=["host", pytest.param("cuda", marks=gpu), pytest.param("cupy", marks=gpu)])
def kernels(request, monkeypatch):
    """Each kernel test runs three times: on the GPU as nvcc built them and as CuPy's NVRTC
    compiles them (runtime.py, arguments passed by CuPy), and on kernels.cu compiled for the
    CPU, which checks the kernels' own code (indexing, vectors, tails, every op and dtype)
    anywhere."""
    pytest.importorskip("torch")
    if request.param == "host":
        return Kernels("cpu", request.getfixturevalue("host_kernels"))
    _torch_cuda()
    if request.param == "cupy":
        pytest.importorskip("cupy")
        monkeypatch.setenv("COMMLIB_CUDA_RUNTIME", "cupy")
        cuda.kernels.cache_clear()
        request.addfinalizer(cuda.kernels.cache_clear)
    return Kernels("cuda")


REFERENCE = {"sum": lambda a, b: a + b, "prod": lambda a, b: a * b, "avg": lambda a, b: a + b,
             "min": lambda a, b: __import__("torch").minimum(a, b),
             "max": lambda a, b: __import__("torch").maximum(a, b)}


def _random(torch, dtype: str, count: int, offset: int, seed: int, device: str):
    """count elements of dtype, offset elements into their allocation (1: not 16-byte
    aligned); floats start with NaN, 1 and inf."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-100, 100, (count + offset,), generator=g) if not dt.is_floating_point
         else torch.randn(count + offset, generator=g)).to(dt).to(device)[offset:]
    if dt.is_floating_point:
        x[:3] = torch.tensor([float("nan"), 1.0, float("inf")])[:count]
    return x


def _compute_dtype(torch, x):
    """What the kernels compute in: float for the 16-bit floats, the type itself otherwise."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


@pytest.mark.parametrize("dtype", cuda.DTYPES)
@pytest.mark.parametrize("op", cuda.OPS)
@pytest.mark.parametrize("count,offset", [(1, 0), (1000, 0), (4099, 1), (1 << 20, 0)])
def test_reduce_matches_torch(kernels, dtype, op, count, offset):
    torch = __import__("torch")
    a = _random(torch, dtype, count, offset, count + offset, kernels.device)
    b = _random(torch, dtype, count, offset, count + offset + 1, kernels.device)
    out = torch.empty_like(a)
    kernels.reduce(out, a, b, op)
    compute = _compute_dtype(torch, a)
    want = REFERENCE[op](a.to(compute), b.to(compute)).to(a.dtype)
    kernels.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", cuda.DTYPES)
@pytest.mark.parametrize("sources", [1, 3, 16])
def test_reduce_n_matches_torch(kernels, dtype, sources):
    """The IPC collectives' kernel: sources combined in order, in the compute type, rounded
    once, into every target; in place into sources (as two-shot and registered memory do)
    and into a fresh array, aligned and not."""
    torch = __import__("torch")
    for op in cuda.OPS:
        for count, offset in [(4099, 0), (517, 1)]:
            xs = [_random(torch, dtype, count, offset, 7 * k + count, kernels.device)
                  for k in range(sources)]
            compute = _compute_dtype(torch, xs[0])
            want = xs[0].to(compute)
            for x in xs[1:]:
                want = REFERENCE[op](want, x.to(compute))
            targets = xs[:2] + [_random(torch, dtype, count, offset, 1, kernels.device)]
            kernels.reduce_n(targets, xs, op)
            kernels.synchronize()
            for k, out in enumerate(targets):
                torch.testing.assert_close(out, want.to(out.dtype), rtol=0, atol=0,
                                           equal_nan=True,
                                           msg=lambda m: f"{op} {count} {offset} #{k}: {m}")


@pytest.mark.parametrize("src", cuda.FLOATING)
@pytest.mark.parametrize("dst", cuda.FLOATING)
@pytest.mark.parametrize("offset", [0, 1])
def test_cast_and_scale_match_torch(kernels, src, dst, offset):
    torch = __import__("torch")
    x = (torch.randn(5003 + offset, dtype=torch.float64) * 1e3).to(getattr(torch, src))
    x = x.to(kernels.device)[offset:]
    y = torch.empty(5003, device=kernels.device, dtype=getattr(torch, dst))
    kernels.cast(y, x)
    kernels.synchronize()
    torch.testing.assert_close(y, x.to(torch.float32).to(y.dtype)
                               if src == "float64" and dst in ("float16", "bfloat16")
                               else x.to(y.dtype), rtol=0, atol=0)
    z = torch.empty(5003 + offset, device=kernels.device, dtype=x.dtype)[offset:]
    z.copy_(x)
    want = x * 0.25
    kernels.scale(z, 0.25)
    kernels.synchronize()
    torch.testing.assert_close(z, want, rtol=0, atol=0)


def test_copy_any_alignment(kernels):
    torch = __import__("torch")
    src = torch.arange(4133, dtype=torch.uint8).to(kernels.device)
    for start, length in [(0, 4133), (0, 4096), (1, 4000), (3, 17), (16, 1)]:
        dst = torch.zeros(length, dtype=torch.uint8, device=kernels.device)
        kernels.copy(dst, src[start:start + length])
        kernels.synchronize()
        assert torch.equal(dst, src[start:start + length]), (start, length)


def _wire_data(torch, count: int, seed: int, finite: bool = True):
    """float32 data whose blocks span magnitudes (1e-30 to 1e30), with a zero run, tiny
    subnormals, values past fp16's range and, unless ``finite``, NaN and infinity."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, generator=g) * torch.exp(
        torch.empty(count).uniform_(-69, 69, generator=g))
    x[5:40] = 0.0
    x[40:45] = torch.tensor([1e-45, -3e-44, 1e-40, 0.0, -0.0])[:max(0, min(5, count - 40))]
    x[50:55] = torch.tensor([7e4, -1e5, 65519.0, 65520.0, 448.5])[:max(0, min(5, count - 50))]
    if not finite and count > 300:
        x[300], x[301] = float("nan"), float("inf")
    return x.float()


def _bits(t):
    """A tensor's bits on the host (float32 as int32, so that NaN equals itself)."""
    torch = __import__("torch")
    return t.cpu() if t.dtype == torch.uint8 else t.cpu().view(torch.int32)


@pytest.mark.parametrize("fmt", cuda.WIRE_FORMATS)
@pytest.mark.parametrize("block", [32, 256])
def test_wire_kernels_make_the_cpus_packets_bit_for_bit(kernels, fmt, block):
    """wire.cu against csrc/wire.cpp: encode (with and without a residual, the residual's
    new bits too), decode_sum of 3 packets (and a factor), sum_encode; odd counts, a last
    block cut short, packets at odd addresses (as a rank's parts lie in one buffer)."""
    torch = __import__("torch")
    from commlib import _C
    code = cuda.WIRE_FORMATS.index(fmt)
    for count in (1, 37, 4099):
        size = _C.wire_packet_bytes(code, count, block)
        xs = [_wire_data(torch, count, 3 * count + k) for k in range(3)]
        residuals = [torch.randn(count, generator=torch.Generator().manual_seed(k)) * 1e-3
                     for k in range(3)]
        # the CPU's packets, 1 byte into one buffer apiece
        cpu = torch.zeros(3 * (size + 1), dtype=torch.uint8)
        cpu_res = [r.clone() for r in residuals]
        for k in range(3):
            _C.wire_encode(xs[k].data_ptr(), cpu_res[k].data_ptr() if k else 0,
                           cpu.data_ptr() + k * (size + 1) + 1, count, code, block)
        dev = torch.zeros_like(cpu).to(kernels.device)
        dev_x = [x.to(kernels.device) for x in xs]
        dev_res = [r.clone().to(kernels.device) for r in residuals]
        for k in range(3):
            kernels.wire("wire_encode", dev_x[k].data_ptr(), dev_res[k].data_ptr() if k else 0,
                         dev.data_ptr() + k * (size + 1) + 1, count, code, block)
        kernels.synchronize()
        assert torch.equal(_bits(dev), cpu), (fmt, block, count, "encode")
        for k in (1, 2):
            assert torch.equal(_bits(dev_res[k]), _bits(cpu_res[k])), (fmt, count, "residual")

        packets = [1 + k * (size + 1) for k in range(3)]
        for factor in (1.0, 1 / 3):
            want = torch.empty(count)
            _C.wire_decode_sum(want.data_ptr(), [cpu.data_ptr() + a for a in packets], count,
                               code, block, factor)
            got = torch.empty(count, device=kernels.device)
            kernels.wire("wire_decode_sum", got.data_ptr(), [dev.data_ptr() + a for a in packets],
                         count, code, block, factor)
            kernels.synchronize()
            assert torch.equal(_bits(got), _bits(want)), (fmt, count, factor, "decode_sum")

            want_packet, want_res = torch.zeros(size + 3, dtype=torch.uint8), residuals[0].clone()
            _C.wire_sum_encode(want_packet.data_ptr() + 3, want_res.data_ptr(),
                               [cpu.data_ptr() + a for a in packets], count, code, block, factor)
            got_packet = torch.zeros(size + 3, dtype=torch.uint8, device=kernels.device)
            got_res = residuals[0].clone().to(kernels.device)
            kernels.wire("wire_sum_encode", got_packet.data_ptr() + 3, got_res.data_ptr(),
                         [dev.data_ptr() + a for a in packets], count, code, block, factor)
            kernels.synchronize()
            assert torch.equal(_bits(got_packet), want_packet), (fmt, count, factor, "sum_encode")
            assert torch.equal(_bits(got_res), _bits(want_res)), (fmt, count, factor, "residual")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_wire_block_holding_nan_or_inf_decodes_as_nan_on_the_device(kernels, fmt):
    torch = __import__("torch")
    code, block, count = cuda.WIRE_FORMATS.index(fmt), 64, 640
    x = _wire_data(torch, count, 5, finite=False).to(kernels.device)  # NaN, inf in block 4
    from commlib import _C
    packet = torch.zeros(_C.wire_packet_bytes(code, count, block), dtype=torch.uint8,
                         device=kernels.device)
    kernels.wire("wire_encode", x.data_ptr(), 0, packet.data_ptr(), count, code, block)
    out = torch.empty(count, device=kernels.device)
    kernels.wire("wire_decode_sum", out.data_ptr(), [packet.data_ptr()], count, code, block, 1.0)
    kernels.synchronize()
    out = out.cpu()
    assert out[256:320].isnan().all() and out[:256].isfinite().all() and out[320:].isfinite().all()


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


def test_the_wait_kernel_waits_for_a_cyclic_greater_or_equal(host_kernels):
    """commlib_wait_counter (COMMLIB_CUDA_WAIT=kernel) run on the CPU: it returns at once
    where the counter has reached the value, cyclically as cuStreamWaitValue32's >=, and
    otherwise once another thread raises it."""
    import threading
    import time
    counter = ctypes.c_uint32(0)
    for now, value in [(5, 3), (5, 5), (1, 0xFFFFFFFF), (0x80000000, 1)]:
        counter.value = now
        host_kernels.wait_counter(ctypes.addressof(counter), value)  # returns at once
    for now, value in [(0, 1), (0xFFFFFFFF, 1)]:
        counter.value = now
        raised = threading.Timer(0.05, lambda: setattr(counter, "value", value))
        raised.start()
        start = time.monotonic()
        host_kernels.wait_counter(ctypes.addressof(counter), value)
        assert time.monotonic() - start >= 0.04 and counter.value == value
        raised.join()


@gpu
@pytest.mark.parametrize("how", ["stream", "kernel"])
@pytest.mark.parametrize("case", ["side-stream", "default-stream", "torch-behind", "queue-full"])
def test_a_stream_goes_on_once_the_host_raises_its_counter(case, how):
    """tests/cuda_counter.py CASE, in a process of its own, with each way of waiting
    (COMMLIB_CUDA_WAIT): a stream that never goes on fails the case (after the timeout)
    instead of hanging the suite."""
    _torch_cuda()
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, COMMLIB_CUDA_WAIT=how)
    try:
        done = subprocess.run([sys.executable, str(root / "tests" / "cuda_counter.py"), case],
                              capture_output=True, text=True, timeout=30, env=env, cwd=root)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{case}, {how}: no answer within 30 s (the stream never went on?)\n{e.stdout}")
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)


@gpu
def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    a = cupy.arange(1000, dtype=cupy.float32)
    out = cupy.empty_like(a)
    cuda.reduce(out, a, a, "max")
    cupy.cuda.get_current_stream().synchronize()
    assert bool((out == a).all())


SIMULATED = {"COMMLIB_CUDA_STREAMS": simulated_gpu.SIMULATED}


@pytest.mark.parametrize("n", sizes(1, 2, 3, 4, long=(2, 4)))
def test_calls_on_gpu_memory_on_a_simulated_gpu(n):
    """The staged and IPC calls' ordering (cuda/staging.py, transports/cuda_ipc.py): results, stream
    order, async Works, failures releasing the stream, with "device" arrays in host memory,
    streams run by threads and IPC memory in POSIX shared memory (tests/simulated_gpu.py).
    Whether CUDA does the same is for the GPU tests below."""
    run_checked(n, "tests/mpi/cuda_staged.py", env=SIMULATED)


@pytest.mark.parametrize("n, meet", [(3, "streams"),
                                     pytest.param(4, "proxy", marks=pytest.mark.long)])
def test_ipc_all_reduce_in_many_two_shot_steps_on_a_simulated_gpu(n, meet):
    """4 KiB slots: a call takes many steps, each reduced in two shots; the streams meet by
    themselves (the default) or through the GPU proxies (COMMLIB_GPU_MEET=proxy)."""
    run_checked(n, "tests/mpi/cuda_staged.py", env={
        **SIMULATED, "COMMLIB_CUDA_IPC_SLOT_BYTES": "4096", "COMMLIB_CUDA_IPC_ONE_SHOT_BYTES": "0",
        "COMMLIB_GPU_MEET": meet})



def test_staged_all_reduce_on_a_simulated_gpu():
    """COMMLIB_CUDA_IPC=0: all_reduce staged through host memory like the others."""
    run_checked(3, "tests/mpi/cuda_staged.py", env={**SIMULATED, "COMMLIB_CUDA_IPC": "0"})


def test_send_and_recv_through_a_cuda_aware_mpi_on_a_simulated_gpu():
    """COMMLIB_CUDA_AWARE_MPI=1: send and recv hand MPI device pointers (host memory on the
    simulated GPU) once the stream has done the work before them."""
    run_checked(2, "tests/mpi/cuda_staged.py", env={**SIMULATED, "COMMLIB_CUDA_AWARE_MPI": "1"})


def test_collectives_through_a_cuda_aware_mpi_on_a_simulated_gpu():
    """COMMLIB_CUDA_AWARE_MPI=1 between hosts: MPI's own collectives on the device memory
    itself (host memory on the simulated GPU), in stream order, with nothing copied."""
    run_checked(3, "tests/mpi/cuda_staged.py", env={
        **SIMULATED, "COMMLIB_CUDA_AWARE_MPI": "1", "COMMLIB_TRANSPORT": "mpi"})


def test_calls_on_gpu_memory_on_a_simulated_gpu_over_mpi():
    """As between hosts: the twins go through the mpi4py executor."""
    run_checked(3, "tests/mpi/cuda_staged.py", env={**SIMULATED, "COMMLIB_TRANSPORT": "mpi"})


def test_a_case_past_its_limit_reports_where_each_rank_stands(tmp_path):
    """.ci/gpu's way on a lent GPU, tried on the simulated one: a case that outlives its
    limit (COMMLIB_TEST_CASE_SECONDS) writes each rank's GPU proxy heartbeat, native stacks
    (or threads' wait channels) and Python stacks to hang-r<RANK>.txt in
    COMMLIB_TEST_STACKS_DIR, and the rank exits."""
    code, out = mpirun(2, "tests/mpi/gpu_hang.py", timeout=90, env={
        **SIMULATED, "COMMLIB_TEST_CASE_SECONDS": "8", "COMMLIB_TEST_STACKS_DIR": str(tmp_path)})
    assert code != 0, out
    report = (tmp_path / "hang-r0.txt").read_text()
    assert "rank 0 in a_call_rank_1_never_makes, near its limit" in report, report
    assert "GPU proxy on device 0" in report and "'waiting_for': 2.0" in report, report
    assert "native stacks of pid" in report and ("#0 " in report or "/task/" in report), report
    assert 'File "' in report and "a_call_rank_1_never_makes" in report.split("native")[-1]


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


@pytest.mark.parametrize("n", sizes(1, 3, 4, long=(4,)))
def test_compressed_collectives_on_gpu_memory_on_a_simulated_gpu(n):
    """commlib/compressed_device.py: every format encoded and decoded by wire.cu's kernels
    (compiled for the CPU) gives the CPU path's results and residuals bit for bit."""
    run_checked(n, "tests/mpi/compressed_gpu.py", env=SIMULATED)


@gpu
def test_compressed_collectives_on_gpu_memory():
    """The same on torch CUDA tensors, the ranks sharing device 0."""
    run_checked(2, "tests/mpi/compressed_gpu.py")

# Builds the native extension commlib._C and, where nvcc is found, commlib._cuda (the GPU
# kernels). Metadata lives in pyproject.toml. No fallback: if an extension fails to
# compile, the install fails. Without nvcc (or with COMMLIB_CUDA=0) there is no _cuda, and
# the GPU path compiles the same kernels at run time through CuPy (commlib/cuda/runtime.py).
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from glob import glob
from pathlib import Path

import pybind11
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup


def load_settings():
    """commlib/settings.py, where every variable read here is declared, loaded by path:
    commlib itself is not built yet."""
    spec = importlib.util.spec_from_file_location(
        "commlib_settings", Path(__file__).resolve().parent / "commlib" / "settings.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


settings = load_settings()

# -O3 for vectorisation. No -march=native: the .so must run on other machines;
# AVX2 is used through runtime dispatch inside csrc/kernels.cpp instead.
# -fno-trapping-math lets GCC if-convert the branch-free float16 conversions
# (it will not otherwise speculate a float op that might raise an FP flag);
# values are unchanged, we never read the FP exception flags.
CXX_FLAGS = ["-O3", "-fno-trapping-math"]

# _C's units compile side by side, on every core unless COMMLIB_BUILD_JOBS says how many
ParallelCompile("COMMLIB_BUILD_JOBS", default=0).install()

extensions = [Pybind11Extension(
    "commlib._C",
    sorted(glob("csrc/*.cpp")),
    depends=sorted(glob("csrc/*.h")),
    cxx_std=17,
    extra_compile_args=CXX_FLAGS,
    # Recorded for _C.build_info(); passed to gcc without a shell, so the quotes survive.
    define_macros=[("COMMLIB_CXX_FLAGS", '"%s"' % " ".join(["-std=c++17", *CXX_FLAGS]))],
)]


def find_cuda() -> tuple[str, Path] | tuple[None, None]:
    """nvcc, and the toolkit whose static runtime _cuda links (nvcc may be a wrapper)."""
    if not settings.get("COMMLIB_CUDA"):
        return None, None
    homes = [Path(h) for h in (settings.get("CUDA_HOME"), settings.get("CUDA_PATH")) if h]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(Path(nvcc).resolve().parent.parent)
    homes.append(Path("/usr/local/cuda"))
    for home in homes:
        if (home / "lib64" / "libcudart_static.a").exists():
            return nvcc or str(home / "bin" / "nvcc"), home
    return None, None


NVCC, CUDA_HOME = find_cuda()
# Machine code for Ampere and Hopper, and PTX of the newest for the driver to compile on
# later GPUs. COMMLIB_CUDA_ARCHS="80;90" style lists override it.
ARCHS = [a.strip() for a in settings.get("COMMLIB_CUDA_ARCHS").split(";") if a.strip()]
NVCC_FLAGS = ["-O3", "-std=c++17",
              *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS],
              f"-gencode=arch=compute_{ARCHS[-1]},code=compute_{ARCHS[-1]}"]
# launch.cu includes kernels.cu and wire.cu
CUDA_UNITS = ["csrc/cuda/launch.cu", "csrc/cuda/streams.cu", "csrc/cuda/ipc.cu"]
CUDA_SOURCES = [*CUDA_UNITS, "csrc/cuda/device.h", "commlib/cuda/kernels.cu",
                "commlib/cuda/wire.cu"]

if NVCC:
    extensions.append(Pybind11Extension(
        "commlib._cuda", [], depends=CUDA_SOURCES, cxx_std=17,
        library_dirs=[str(CUDA_HOME / "lib64")],
        # the static runtime: the module imports where no CUDA toolkit is installed
        libraries=["cudart_static", "dl", "rt", "pthread"]))


class BuildExt(build_ext):
    """build_ext that first compiles _cuda's CUDA units with nvcc into objects to link."""

    def build_extension(self, ext):
        if ext.name == "commlib._cuda":  # the units at once: each takes nvcc tens of seconds
            with ThreadPoolExecutor(len(CUDA_UNITS)) as pool:
                ext.extra_objects = list(pool.map(self.nvcc_compile, CUDA_UNITS))
        super().build_extension(ext)

    def nvcc_compile(self, unit: str) -> str:
        """``unit`` compiled into an object, unless one newer than every CUDA source exists."""
        obj = Path(self.build_temp) / (Path(unit).stem + ".o")
        if not obj.exists() or obj.stat().st_mtime < max(
                Path(s).stat().st_mtime for s in CUDA_SOURCES):
            obj.parent.mkdir(parents=True, exist_ok=True)
            flags = " ".join(NVCC_FLAGS)
            subprocess.check_call([
                NVCC, "-c", unit, "-o", str(obj), "-Xcompiler", "-fPIC",
                f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                f'-DCOMMLIB_NVCC_FLAGS="{flags}"', *NVCC_FLAGS])
        return str(obj)


setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})

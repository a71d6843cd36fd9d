# Builds the single native extension commlib._C. Metadata lives in pyproject.toml.
# No fallback: if the extension fails to compile, the install fails.
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

# -O3 for vectorisation. No -march=native: the .so must run on other machines;
# AVX2 is used through runtime dispatch inside csrc/kernels.cpp instead.
# -fno-trapping-math lets GCC if-convert the branch-free float16 conversions
# (it will not otherwise speculate a float op that might raise an FP flag);
# values are unchanged, we never read the FP exception flags.
CXX_FLAGS = ["-O3", "-fno-trapping-math"]

ext = Pybind11Extension(
    "commlib._C",
    sorted(glob("csrc/*.cpp")),
    depends=sorted(glob("csrc/*.h")),
    cxx_std=17,
    extra_compile_args=CXX_FLAGS,
    # Recorded for _C.build_info(); passed to gcc without a shell, so the quotes survive.
    define_macros=[("COMMLIB_CXX_FLAGS", '"%s"' % " ".join(["-std=c++17", *CXX_FLAGS]))],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})

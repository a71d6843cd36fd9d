"""Every environment variable commlib reads, declared once: its name, what it takes, its
default, what it does and where the docs say more (as NCCL declares its NCCL_PARAMs).

Vocabulary: a *setting* is one declared variable; a *family* is one declaration for many
names (``COMMLIB_ALGO_<COLLECTIVE>``: one per collective); a setting's *stage* says who
reads it: the library at run time, setup.py at install, or the tests.

``get(name)`` reads the environment at each call, never at import, so that a process that
changes a variable (the tests' pooled ranks do, per job) sees the new value; a value it
cannot take raises ValueError naming the variable and what it takes. The two the C++
extension reads itself (``read_by``) are declared here too. docs/collectives.md's table of
variables is ``markdown()`` (``python -m commlib.settings`` prints it; tests/test_settings.py
fails when they differ, or when code reads a variable that is not declared).

This module imports nothing of commlib: every layer may read its settings, and setup.py
loads it by path before commlib is built.
"""
import os
from dataclasses import dataclass

RUN, INSTALL, TEST = "run", "install", "test"
FLAG_WORDS = {"1": True, "on": True, "true": True, "yes": True,
              "0": False, "off": False, "false": False, "no": False}


@dataclass(frozen=True)
class Setting:
    """One variable. ``kind``: bool (a flag: 0/1, on/off, true/false, yes/no), int, float,
    str, or a tuple of the strings it may be; ``default``: its value when unset or empty;
    ``least``: the smallest number it takes; ``shown``: the default as the docs show it
    (else derived); ``section``: the docs' link."""
    name: str
    kind: object
    default: object
    effect: str
    section: str
    shown: str | None = None
    least: float | None = None
    stage: str = RUN
    read_by: str = "commlib"

    @property
    def family(self) -> bool:
        return "<" in self.name

    def matches(self, name: str) -> bool:
        if self.family:
            return name.startswith(self.name.split("<")[0])
        return name == self.name

    def parse(self, name: str, text: str):
        """``text`` as this setting takes it, else ValueError naming ``name`` and the fix."""
        if self.kind is bool:
            value = FLAG_WORDS.get(text.strip().lower())
            if value is None:
                raise ValueError(f"{name}={text!r}: expected 1 or 0 (on/off, true/false, "
                                 f"yes/no); unset, it is {self.default_text()}")
            return value
        if isinstance(self.kind, tuple):
            if text not in self.kind:
                raise ValueError(f"{name}={text!r}: expected one of "
                                 f"{', '.join(repr(k) for k in self.kind)}")
            return text
        if self.kind in (int, float):
            try:
                value = self.kind(text)
            except ValueError:
                what = "an integer" if self.kind is int else "a number"
                raise ValueError(f"{name}={text!r}: expected {what}") from None
            if self.least is not None and value < self.least:
                raise ValueError(f"{name}={text!r}: expected a number >= {self.least:g}")
            return value
        return text

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.kind is bool:
            return "on" if self.default else "off"
        return "" if self.default is None else f"`{self.default}`" \
            if isinstance(self.default, str) else str(self.default)


TRANSPORTS_LINK = "[Transports](#transports)"
FAILURES_LINK = "[Disagreements](#when-ranks-disagree-wait-too-long-or-die)"
GPU_LINK = "[gpu.md](gpu.md)"
TESTING_LINK = "[testing.md](testing.md)"

SETTINGS = (
    Setting("COMMLIB_ABORT_ON_EXCEPTION", bool, True,
            "`0`: an uncaught exception does not abort the job", "[Errors](#errors)"),
    Setting("COMMLIB_CHECK", bool, True,
            "`0`: over MPI and gloo, no descriptor exchange before a collective",
            FAILURES_LINK),
    Setting("COMMLIB_TIMEOUT", float, 600.0, "seconds any wait may take; `0` = none",
            "[Timeouts](#when-ranks-disagree-wait-too-long-or-die)", shown="600", least=0),
    Setting("COMMLIB_FLIGHT_RECORDER", int, 64,
            "calls each communicator keeps in its flight recorder",
            "[Flight recorder](#when-ranks-disagree-wait-too-long-or-die)", least=0),
    Setting("COMMLIB_TRACE", str, None,
            "a directory: every rank writes its timeline there (and failures their records)",
            "[Timeline](#timeline)", shown="off"),
    Setting("COMMLIB_TRACE_CALLS", int, 100000,
            "under `COMMLIB_TRACE`, calls each communicator keeps", "[Timeline](#timeline)",
            least=0),
    Setting("COMMLIB_DETERMINISTIC", bool, False,
            "`1`: the world's reducing collectives reduce in rank order (and communicators "
            "split or duplicated from it)", "[Deterministic mode](#deterministic-mode)"),
    Setting("COMMLIB_ALGO_<COLLECTIVE>", str, None,
            "algorithm for that collective, e.g. `COMMLIB_ALGO_ALL_REDUCE=ring`; read when a "
            "communicator is created", "[Algorithm choice](#algorithm-choice)",
            shown="cost model"),
    Setting("COMMLIB_TUNING", str, "",
            "`off`: no measured table, the cost model's defaults; `refresh`: measure the "
            "table again; else the cost model's tuning file, which `commlib-bench calibrate` "
            "writes", "[Algorithm choice](#algorithm-choice)",
            shown="`~/.config/commlib/tuning.json`"),
    Setting("COMMLIB_TRANSPORT", str, "auto",  # (transports.pick checks the name)
            "`mpi`: use the mpi4py executor; `shm`, `hosts`, `net`: insist on that transport",
            TRANSPORTS_LINK, shown="automatic"),
    Setting("COMMLIB_CROSS", ("net", "mpi", "gloo"), "net",
            "what joins the hosts instead of TCP: under mpiexec `mpi` (MPI's messages and "
            "agreement: the `hosts` transport's MPI form; `mpi` for uneven layouts), under "
            "torchrun `gloo` (torch's gloo: `hosts` over gloo, `gloo` for uneven layouts)",
            TRANSPORTS_LINK),
    Setting("COMMLIB_SOCKET_IFNAME", str, None,
            "the interface whose IPv4 address a rank's peers connect to (the `net` "
            "transport)", TRANSPORTS_LINK),
    Setting("COMMLIB_RANKS_PER_HOST", int, None,
            "`k`: world ranks `[0,k), [k,2k), ...` behave as separate hosts", TRANSPORTS_LINK,
            least=1),
    Setting("COMMLIB_HOSTID", str, None,
            "the host a process of a store world (`from_store`, torchrun) counts as: same "
            "id, shared memory; different, TCP (as NCCL_HOSTID)",
            "[Dead ranks](#when-ranks-disagree-wait-too-long-or-die)", shown="hostname"),
    Setting("COMMLIB_SEGMENT_BYTES", int, 1 << 20,
            "segment size of large transfers on the `mpi` transport", TRANSPORTS_LINK,
            shown="1 MiB", least=1),
    Setting("COMMLIB_SCRATCH_SLOTS", int, 4,
            "receive-scratch slots a plan on the `mpi` transport reuses in turn",
            TRANSPORTS_LINK, least=1),
    Setting("COMMLIB_FAST_PATH", bool, True,
            "`0`: no fast path for numpy collectives (shared memory; eager and MPI's own "
            "over MPI)", TRANSPORTS_LINK),
    Setting("COMMLIB_ONE_COPY", bool, True,
            "`0`: no `one_copy` collectives (reading peers' memory with `process_vm_readv`)",
            TRANSPORTS_LINK),
    Setting("COMMLIB_SHM_SLOT_BYTES", int, 64 << 10, "shared-memory tuning", TRANSPORTS_LINK,
            shown="64 KiB", least=1),
    Setting("COMMLIB_SHM_SLOTS", int, 8, "shared-memory tuning", TRANSPORTS_LINK, least=1),
    Setting("COMMLIB_SHM_STAGING_BYTES", int, 1 << 20, "shared-memory tuning",
            TRANSPORTS_LINK, shown="1 MiB", least=1),
    Setting("COMMLIB_SHM_SPIN", int, 20_000, "polls before a waiting rank yields",
            TRANSPORTS_LINK, least=0),
    Setting("COMMLIB_SIMD", ("baseline",), None,
            "`baseline`: the C++ kernels without their AVX2/F16C clones (read once, when "
            "`commlib._C` loads)", TESTING_LINK, read_by="csrc/kernels.cpp"),
    Setting("COMMLIB_CUDA_IPC", bool, True, "`0`: no CUDA IPC for GPU collectives", GPU_LINK),
    Setting("COMMLIB_CUDA_IPC_SLOT_BYTES", int, 16 << 20,
            "size of each of the two slots of a rank's CUDA IPC workspace", GPU_LINK,
            shown="16 MiB", least=1),
    Setting("COMMLIB_CUDA_IPC_ONE_SHOT_BYTES", int, 256 << 10,
            "largest chunk that all_reduce through IPC reduces one-shot (at 2 ranks it "
            "always does)", GPU_LINK, shown="256 KiB", least=0),
    Setting("COMMLIB_GPU_MEET", ("streams", "proxy"), "streams",
            "`proxy`: every meeting of a call through CUDA IPC goes through the GPU proxies, "
            "not only its first (the streams wait for each other's arrivals by default)",
            GPU_LINK),
    Setting("COMMLIB_GPU_PROXY_SPIN", int, 2000,
            "polls before a GPU proxy yields, where each rank has a core of its own",
            GPU_LINK, least=0),
    Setting("COMMLIB_CUDA_AWARE_MPI", ("0", "1"), None,
            "`1` or `0`: whether MPI is handed device memory", GPU_LINK,
            shown="what `MPIX_Query_cuda_support` says"),
    Setting("COMMLIB_CUDA_RUNTIME", ("cupy",), None,
            "`cupy`: use the CuPy path where both it and the compiled `commlib._cuda` are "
            "available", GPU_LINK),
    Setting("COMMLIB_CUDA_WAIT", ("kernel",), None,
            "`kernel`: streams wait for the host's counters by a kernel instead of "
            "`cuStreamWaitValue32`", "[gpu.md](gpu.md#kernels)",
            read_by="commlib and csrc/cuda/streams.cu"),
    Setting("COMMLIB_CUDA_STREAMS", str, None,
            "`module:class` of an object with `commlib._cuda`'s stream calls that the GPU "
            "path uses instead (the tests' simulated GPU: "
            "`tests.simulated_gpu:SimulatedDevice`)", TESTING_LINK),
    Setting("COMMLIB_CUDA", bool, True, "at install: `0` skips compiling `commlib._cuda`",
            GPU_LINK, stage=INSTALL),
    Setting("COMMLIB_CUDA_ARCHS", str, "80;90",
            "at install: the GPU architectures `commlib._cuda` is compiled for, e.g. "
            "`\"80;90\"`", GPU_LINK, shown="sm_80 and sm_90 plus PTX", stage=INSTALL),
    Setting("COMMLIB_BUILD_JOBS", int, 0,
            "at install: how many of `commlib._C`'s units compile at once (`0`: one per core)",
            "[README](../README.md#install-and-run)", stage=INSTALL,
            read_by="setup.py (pybind11's ParallelCompile)"),
    Setting("CUDA_HOME", str, None, "at install: where `nvcc` is looked for, besides PATH",
            GPU_LINK, stage=INSTALL),
    Setting("CUDA_PATH", str, None, "at install: as `CUDA_HOME`, where that is unset",
            GPU_LINK, stage=INSTALL),
    Setting("COMMLIB_TEST_DEVICE", str, "cpu",
            "tests: `cuda`, the strategies' equivalence scripts run on the GPU", TESTING_LINK,
            shown="", stage=TEST),
    Setting("COMMLIB_TEST_CASES", str, None,
            "tests: the cases a script under tests/mpi runs, comma-separated (else all)",
            TESTING_LINK, stage=TEST),
    Setting("COMMLIB_TEST_CASE_SECONDS", float, None,
            "tests: each case's own limit, after which every rank writes its stacks and "
            "exits", TESTING_LINK, least=0, stage=TEST),
    Setting("COMMLIB_TEST_STACKS", float, None,
            "tests: seconds after which a script's ranks write their stacks and exit",
            TESTING_LINK, least=0, stage=TEST),
    Setting("COMMLIB_TEST_STACKS_DIR", str, None,
            "tests: where those stacks go (`hang-r<rank>.txt`; else standard error)",
            TESTING_LINK, stage=TEST),
    Setting("COMMLIB_AS_GLOO", bool, False,
            "tests: `1` (with `BACKEND=gloo`), PyTorch's suite runs every test as for gloo on "
            "commlib groups", TESTING_LINK, stage=TEST),
    Setting("OUT", str, None, "tests: where `.ci/gpu` writes its logs (else `gpu-logs/`)",
            TESTING_LINK, stage=TEST, read_by=".ci/gpu"),
)


_BY_NAME = {s.name: s for s in SETTINGS}
_FAMILIES = tuple(s for s in SETTINGS if s.family)


def declaration(name: str) -> Setting:
    """The setting that declares ``name``; KeyError, naming this file, if none does."""
    found = _BY_NAME.get(name) or next((s for s in _FAMILIES if s.matches(name)), None)
    if found is None:
        raise KeyError(f"{name} is not declared in commlib/settings.py; declare it there")
    return found


def get(name: str):
    """``name``'s value now: parsed as declared, its default when unset or empty."""
    setting = declaration(name)
    text = os.environ.get(name, "")
    return setting.default if text == "" else setting.parse(name, text)


def markdown() -> str:
    """The table of every variable, as docs/collectives.md shows it."""
    rows = ["| Variable | Default | Effect | Described in |", "|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.default_text()} | {s.effect} | {s.section} |"
             for s in SETTINGS]
    return "\n".join(rows).replace("|  |", "| |") + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

"""Communicator.empty: host memory every rank maps (commlib/host_memory.py), and the
one_copy collectives reading it where it lies; mixed with ordinary memory on some ranks
(on huge pages: read in place with process_vm_readv; on 4 KiB pages: the call stages);
freed regions unpublished and unmapped; refused shapes; other transports.

Usage: mpiexec -n N python tests/mpi/host_memory.py
"""
import gc
import mmap
import os

import numpy as np
from mpi4py import MPI

import commlib
from commlib.errors import CollectiveMismatchError
from harness import Checker, assert_equal, raises, torch

comm = commlib.init()
n, rank = comm.size, comm.rank
check = Checker()
SHARED = comm.transport == "shm"
ALGORITHMS = ["one_copy", "auto"] if "one_copy" in comm.algorithms("all_reduce") else ["auto"]


def _mapped(path_part: str) -> bool:
    with open("/proc/self/maps") as maps:
        return path_part in maps.read()


def _own_segments() -> set:
    with open("/proc/self/maps") as maps:
        return {line.split()[-2] if line.endswith("(deleted)\n") else line.split()[-1]
                for line in maps if f"commlib-{os.getuid()}-{os.getpid()}-m" in line}


HUGE_PAGE = 2 << 20


def private(count: int, dtype, huge: bool) -> np.ndarray:
    """``count`` zeros of ordinary (private) memory from a 2 MiB boundary, asked to lie on
    huge pages, or on 4 KiB ones."""
    nbytes = count * np.dtype(dtype).itemsize
    raw = mmap.mmap(-1, -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE,
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    whole = np.frombuffer(raw, np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE
    array = whole[skip:skip + nbytes].view(dtype)
    array[...] = 0
    return array


def on_huge_pages(array: np.ndarray) -> bool:
    """Whether the kernel put ``array``'s mapping on huge pages (/proc/self/smaps)."""
    at, inside = array.ctypes.data, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            field = line.split()
            if "-" in field[0] and not field[0].endswith(":"):
                low, high = (int(x, 16) for x in field[0].split("-"))
                inside = low <= at < high
            elif inside and field[0] == "AnonHugePages:":
                return int(field[1]) > 0
    return False


def read_in_place(on=comm) -> int:
    """Calls so far that read the peers' buffers where they lie, on communicator ``on``
    (white-box)."""
    return on._transport.shm.calls_read_in_place if SHARED else 0


def in_place(call, on=comm) -> int:
    """Whether ``call`` (on communicator ``on``) read the peers' buffers where they lie."""
    before = read_in_place(on)
    call()
    return read_in_place(on) - before


def arrays_of_every_kind():
    a = comm.empty((3, 4), np.int32)
    assert a.shape == (3, 4) and a.dtype == np.int32
    t = comm.empty(5, torch.bfloat16)
    assert t.shape == (5,) and t.dtype == torch.bfloat16
    t.fill_(rank + 1)
    comm.all_reduce(t)
    assert_equal(t.float().numpy(), np.full(5, n * (n + 1) / 2))
    if SHARED:
        assert _own_segments(), "comm.empty is not in shared memory"


def collectives_on_shared_memory():
    """Every one_copy collective with inputs and outputs in comm.empty memory; on odd
    ranks the output (or input) is ordinary memory on huge pages, read with
    process_vm_readv: every call reads in place, where the kernel gave huge pages."""
    for count in (0, 1, 13, (1 << 16) + 3):
        for algo in ALGORITHMS:
            a = None if algo == "auto" else algo
            huge = []

            def alloc(c):  # (collective: every rank allocates, the odd ones use their own)
                shared = comm.empty(c, np.float64)
                if rank % 2 == 0:
                    return shared
                mine = private(c, np.float64, huge=True)
                huge.append(c == 0 or on_huge_pages(mine))
                return mine
            before = read_in_place()
            buf = alloc(count)
            buf[:] = np.arange(count) + rank
            comm.all_reduce(buf, algorithm=a)
            assert_equal(buf, n * np.arange(count) + n * (n - 1) / 2)
            src, out = comm.empty(count * n, np.float64), alloc(count)
            src[:] = np.arange(count * n) * (rank + 1)
            comm.reduce_scatter(out, src, algorithm=a)
            assert_equal(out, (np.arange(count * n) * n * (n + 1) / 2)[rank * count:][:count])
            mine, gathered = alloc(count), comm.empty(count * n, np.float64)
            mine[:] = rank
            comm.all_gather(gathered, mine, algorithm=a)
            assert_equal(gathered, np.repeat(np.arange(n, dtype=float), count))
            b = alloc(count)
            b[:] = rank
            comm.broadcast(b, root=n - 1, algorithm=a)
            assert_equal(b, np.full(count, n - 1.0))
            send = [(rank + j) % 3 * (count % 5 + 1) for j in range(n)]
            recv = [(j + rank) % 3 * (count % 5 + 1) for j in range(n)]
            most = 2 * n * (count % 5 + 1)  # (allocations are collective: one size)
            x, y = comm.empty(most, np.float64)[:sum(send)], alloc(most)[:sum(recv)]
            x[:] = np.repeat([100 * rank + j for j in range(n)], send)
            comm.all_to_all(y, x, recv, send, algorithm=a)
            assert_equal(y, np.repeat([100 * j + rank for j in range(n)], recv))
            if a == "one_copy" and n > 1 and count and comm.mpi.allreduce(all(huge),
                                                                          op=MPI.LAND):
                calls = read_in_place() - before
                assert calls == 5, f"on huge pages, {calls} of 5 calls read in place"


def ordinary_memory_on_small_pages_stages():
    """Where any rank's buffer lies on 4 KiB pages, every rank stages the one_copy call
    (pinning those pages costs more than staging them), with the same results; all_to_all
    (direct's, and one_copy's staged as direct's) reads in place the parts of every rank
    whose input lies on huge pages, and stages the others'."""
    if "one_copy" not in ALGORITHMS or n == 1:
        return
    count = 3 << 16  # 1.5 MiB of float32 a rank: within one huge page, and several pieces
    for small_on in (None, n - 1, 0):
        mine = private(count * n, np.float32, huge=rank != small_on)
        out = private(count * n, np.float32, huge=rank != small_on)
        huge = on_huge_pages(mine)
        all_huge = comm.mpi.allreduce(huge, op=MPI.LAND)
        any_huge = comm.mpi.allreduce(huge, op=MPI.LOR)
        assert not (small_on is not None and all_huge)
        mine[:] = rank + 1
        assert in_place(lambda: comm.all_reduce(mine, algorithm="one_copy")) == all_huge
        assert_equal(mine, np.full(count * n, n * (n + 1) / 2, np.float32))
        mine[:] = np.arange(count * n) % 7 + rank
        want = np.concatenate([np.arange(rank * count, (rank + 1) * count) % 7 + j
                               for j in range(n)]).astype(np.float32)
        for algorithm in ("one_copy", "direct"):
            out[:] = -1
            assert in_place(lambda: comm.all_to_all(out, mine, algorithm=algorithm)) \
                == any_huge, (algorithm, small_on)
            assert_equal(out, want)
        assert in_place(lambda: comm.all_gather(out, mine[:count], algorithm="one_copy")) \
            == all_huge
        assert_equal(out, np.concatenate([np.arange(count) % 7 + j for j in range(n)])
                     .astype(np.float32))
        # broadcast reads the root's buffer in place where it lies on huge pages, and the
        # root writes its share only into readers' buffers that do
        root_huge = comm.mpi.bcast(huge, root=0)
        mine[:] = np.arange(count * n) % 11 if rank == 0 else -1
        assert in_place(lambda: comm.broadcast(mine, root=0, algorithm="one_copy")) \
            == root_huge, small_on
        assert_equal(mine, (np.arange(count * n) % 11).astype(np.float32))


def each_call_is_judged_by_its_own_buffer():
    """direct's all_to_all looks at this call's input, not the last call's: calls that
    alternate between huge and 4 KiB pages read in place exactly on the huge ones."""
    if "one_copy" not in ALGORITHMS or n == 1:
        return
    count = 3 << 16
    inputs = [private(count * n, np.float32, huge=huge) for huge in (True, False)]
    out = private(count * n, np.float32, huge=False)
    huge = comm.mpi.allreduce(on_huge_pages(inputs[0]), op=MPI.LAND)
    want = np.repeat(np.arange(n, dtype=np.float32), count)
    for kind in (0, 1, 0, 1):
        inputs[kind][:] = rank
        out[:] = -1
        assert in_place(lambda: comm.all_to_all(out, inputs[kind], algorithm="direct")) \
            == (huge and kind == 0), (kind, huge)
        assert_equal(out, want)


def one_copy_reads_from_anywhere_in_a_page():
    """Buffers on huge pages that start anywhere in a page read in place right, over
    several chunks: the reductions' slots lie at each chunk's offset in its page, each
    rank's buffer elsewhere; a read into memory 16 bytes past its source (modulo 4 KiB),
    where the kernel's copy runs slow, goes through such a slot (csrc/shm_one_copy.cpp);
    a broadcast into buffers at the root's offset, where the root writes a share of each
    reader's, and 16 bytes past it, where the readers read it all."""
    if "one_copy" not in ALGORITHMS or n == 1:
        return
    count = 3 << 16
    values = np.arange(count * n, dtype=np.float32) % 251

    def at(skip):  # (float32 elements into a 4 KiB page, on huge pages)
        return private(count * n + 2048, np.float32, huge=True)[skip:skip + count * n]
    for skip in (0, 1, 5, 1023):
        src, out = at((skip + 7 * rank) % 1024), at(1023 - (skip + 7 * rank) % 1024)
        huge = comm.mpi.allreduce(on_huge_pages(src) and on_huge_pages(out), op=MPI.LAND)
        src[:] = values * (rank + 1)
        assert in_place(lambda: comm.reduce_scatter(out[:count], src, algorithm="one_copy")) \
            == huge
        assert_equal(out[:count], values[rank * count:][:count] * (n * (n + 1) // 2))
        assert in_place(lambda: comm.all_reduce(src, algorithm="one_copy")) == huge
        assert_equal(src, values * (n * (n + 1) // 2))
        mine, trailing = at(skip), at(skip + 4)  # (every read 16 bytes past its source)
        mine[:] = values + rank
        assert in_place(lambda: comm.all_gather(trailing, mine[:count], algorithm="one_copy")) \
            == huge
        assert_equal(trailing, np.concatenate([values[:count] + j for j in range(n)]))
        assert in_place(lambda: comm.all_to_all(trailing, mine, algorithm="one_copy")) == huge
        assert_equal(trailing, np.concatenate([values[rank * count:][:count] + j
                                               for j in range(n)]))
        read = mine if rank == 0 else trailing
        assert in_place(lambda: comm.broadcast(read, root=0, algorithm="one_copy")) == huge
        assert_equal(read, values)
        mine[:] = values if rank == n - 1 else -1  # (at one offset: the root writes a share)
        assert in_place(lambda: comm.broadcast(mine, root=n - 1, algorithm="one_copy")) \
            == huge
        assert_equal(mine, values)


def a_table_decides_how_to_read_in_place():
    """Where the algorithm table measured that reading 4 KiB pages in place beats staging
    them for a collective (tuning.Table.base_pages_in_place), one_copy and direct's
    all_to_all read them in place for that collective alone; direct's all_to_all reads
    parts in place from the size the table says (parts_in_place_from); no table: as
    before."""
    if "one_copy" not in ALGORITHMS or n == 1:
        return
    from commlib import tuning
    count = 3 << 16  # (several pieces: direct's all_to_all would read in place on huge pages)
    mine, out = (private(count * n, np.float32, huge=False) for _ in range(2))
    assert not comm.mpi.allreduce(on_huge_pages(mine), op=MPI.LOR)
    gathered = np.repeat(np.arange(n, dtype=np.float32), count)
    fresh = comm.dup()
    for reads in (["all_gather", "all_to_all"], ["all_reduce"], []):
        fresh.algorithm_table = tuning.Table({}, {}, reads)
        mine[:] = rank + 1
        assert in_place(lambda: fresh.all_reduce(mine, algorithm="one_copy"), fresh) \
            == ("all_reduce" in reads)
        assert_equal(mine, np.full(count * n, n * (n + 1) / 2, np.float32))
        mine[:] = rank
        assert in_place(lambda: fresh.all_gather(out, mine[:count], algorithm="one_copy"),
                        fresh) == ("all_gather" in reads)
        assert_equal(out, gathered)
        out[:] = -1
        assert in_place(lambda: fresh.all_to_all(out, mine, algorithm="direct"), fresh) \
            == ("all_to_all" in reads)
        assert_equal(out, gathered)
    small = 768 * n  # parts of 3 KiB: staged unless the table says otherwise
    for parts_from in (-1, 3 << 10, 4 << 10, 0):
        fresh.algorithm_table = tuning.Table({}, {}, ["all_to_all"], parts_from)
        out[:] = -1
        assert in_place(lambda: fresh.all_to_all(out[:small], mine[:small],
                                                 algorithm="direct"), fresh) \
            == (0 <= parts_from <= 3 << 10), parts_from
        assert_equal(out[:small], np.repeat(np.arange(n, dtype=np.float32), small // n))
    fresh.algorithm_table = None
    assert not in_place(lambda: fresh.broadcast(mine, algorithm="one_copy"), fresh)
    fresh.free()


def in_place_forms():
    count = 1000
    g = comm.empty(count * n, np.float32)
    g[rank * count:(rank + 1) * count] = rank
    comm.all_gather(g, g[rank * count:(rank + 1) * count], algorithm=ALGORITHMS[0])
    assert_equal(g, np.repeat(np.arange(n, dtype=np.float32), count))
    r = comm.empty(count * n, np.float32)
    r[:] = 1
    comm.reduce_scatter(r[rank * count:(rank + 1) * count], r, algorithm=ALGORITHMS[0])
    assert_equal(r[rank * count:(rank + 1) * count], np.full(count, float(n)))


def freed_memory_is_unpublished_and_unmapped():
    """The owner unmaps a region once nothing uses it (a torch view keeps it alive), and
    the peers drop their mappings of it at the next allocation."""
    if not SHARED:
        return
    before = _own_segments()
    t = torch.from_numpy(comm.empty(100, np.float32))[10:20]
    mine = _own_segments() - before
    assert len(mine) == 1
    t.fill_(rank)
    comm.all_reduce(t, algorithm=ALGORITHMS[0])
    gc.collect()
    assert _mapped(next(iter(mine))), "unmapped while a tensor still uses it"
    assert_equal(t.numpy(), np.full(10, n * (n - 1) / 2))
    name = next(iter(mine)).rsplit("/", 1)[-1]
    del t
    gc.collect()
    assert not _mapped(name), "freed memory is still mapped"
    names = MPI.COMM_WORLD.allgather(name)
    fresh = comm.empty(10, np.float32)  # the peers hear of the freed regions here
    for peer, theirs in enumerate(names):
        assert not _mapped(theirs), f"rank {peer}'s freed memory is still mapped here"
    fresh[:] = 1  # ordinary memory now where the freed region was: read the other way
    plain = np.full(1 << 12, rank + 1.0)
    comm.all_reduce(plain, algorithm=ALGORITHMS[0])
    assert_equal(plain, np.full(1 << 12, n * (n + 1) / 2))


def a_failed_set_up_leaves_nothing_in_dev_shm():
    """Every rank's object is made, but no rank may map it (its address space is full): the
    call fails on every rank, and no object is left behind."""
    if not SHARED:
        return
    import resource
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, ((used << 10) + (256 << 20), hard))
    try:
        raises(commlib.CommError, "could not be set up", lambda: comm.empty(4 << 30, np.uint8))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    mine = f"commlib-{os.getuid()}-{os.getpid()}-m"
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(mine)]


def different_shapes_are_refused():  # (last: a disagreement ends the communicator)
    if not SHARED or n == 1:
        return
    MPI.COMM_WORLD.Barrier()  # (a rank still finishing the last call would hear of it there)
    raises(CollectiveMismatchError, "(count differs)",
           lambda: comm.empty(100 + rank * 4096, np.uint8))


check.run_cases(globals())

"""The GPU proxy (csrc/gpu_proxy.h) by itself, in one process: ranks are proxies over one
channel, streams are the test writing their arrival words. Its meetings, rows, failures
(a mismatch, a timeout, a dead peer) and what a failure does to the counters; where the
streams meet by themselves, what it serves and watches."""
import ctypes
import subprocess
import sys
import threading
import time

import pytest

from commlib import CollectiveMismatchError, CommError, CommTimeoutError, _C

ROW = _C.GPU_PROXY_ROW_WORDS
GO0, GO1, FREE, ARRIVE0, ARRIVE1 = range(5)


class Rank:
    """One rank's proxy and its pinned words (plain memory here)."""

    def __init__(self, rank: int, size: int, channel: str = "", streams_meet: bool = False):
        self.memory = (ctypes.c_uint8 * (5 * 64))()
        self.proxy = _C.GpuProxy(rank, size, channel, rank == 0, [self.at(k) for k in range(5)],
                                 0, streams_meet)
        self.rank, self.streams_meet = rank, streams_meet

    def at(self, k: int) -> int:
        return ctypes.addressof(self.memory) + 64 * k

    def word(self, k: int) -> int:
        return ctypes.c_uint32.from_address(self.at(k)).value

    def arrival(self, r: int, k: int) -> ctypes.c_uint32:
        """Rank r's arrival word for meeting k, as this rank maps it (streams meet)."""
        return ctypes.c_uint32.from_address(self.proxy.arrival(r, k))

    def arrive(self, k: int, value: int) -> None:  # what the stream's write_value does
        word = (self.arrival(self.rank, k) if self.streams_meet
                else ctypes.c_uint32.from_address(self.at(ARRIVE0 + k)))
        word.value = value


def ranks(size: int, streams_meet: bool = False) -> list[Rank]:
    first = Rank(0, size, "", streams_meet)
    every = [first] + [Rank(r, size, first.proxy.channel, streams_meet) for r in range(1, size)]
    first.proxy.unlink()
    return every


def row(count: int, extra=(0, 0)) -> list[int]:
    desc = [1, 0, count, 2, 0, -1, 0, 0]  # all_reduce of count float32
    return desc + [0] * (ROW - 2 - len(desc)) + list(extra)


def past(word: int, step: int) -> bool:
    """Whether a stream waiting for ``word`` >= ``step`` (cyclically) goes on."""
    return (word - step) % 2 ** 32 < 2 ** 31


def wait_until(condition, seconds=5.0):
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "not within 5 s"
        time.sleep(1e-3)


def test_steps_meet_and_raise_the_counters():
    every = ranks(3)
    ids = [r.proxy.submit(0, 3, 2, row(10), 4, False, False, 5.0) for r in every]
    for s in range(3):
        for k in range(2):
            for r in every:
                r.arrive(k, s + 1)
            wait_until(lambda: all(r.word(GO0 + k) == s + 1 for r in every))
        assert all(r.word(FREE) == s for r in every)
    for r, i in zip(every, ids):
        started, ended = r.proxy.wait(i)
        assert started <= ended <= time.monotonic()
        r.proxy.close()


def test_an_exchange_hands_every_rank_every_row():
    every = ranks(2)
    ids = [r.proxy.submit(0, 1, 1, row(10, (r_, 7 * r_)), 4, False, True, 5.0)
           for r_, r in enumerate(every)]
    rows = [r.proxy.rows(i) for r, i in zip(every, ids)]
    assert rows[0] == rows[1] and [x[-2:] for x in rows[0]] == [[0, 0], [1, 7]]
    for r in every:
        r.arrive(0, 1)
    for r, i in zip(every, ids):
        r.proxy.wait(i)
        r.proxy.close()


def test_a_mismatch_fails_every_rank_and_lets_every_stream_go():
    every = ranks(2)
    ids = [r.proxy.submit(0, 4, 1, row(10 + r_), 4, False, False, 5.0)
           for r_, r in enumerate(every)]
    for r in every:
        r.arrive(0, 1)
    for r, i in zip(every, ids):
        with pytest.raises(CollectiveMismatchError, match="count"):
            r.proxy.wait(i)
        assert all(past(r.word(k), 4) for k in (GO0, GO1, FREE))  # every stream goes on
        kind, text = r.proxy.take_failure()
        assert kind and "count" in text and r.proxy.take_failure() == (0, "")  # once
        later = r.proxy.submit(4, 1, 1, row(10), 4, False, False, 5.0)
        with pytest.raises(CommError, match="an earlier collective"):
            r.proxy.wait(later)
        r.proxy.close()


def test_where_streams_meet_the_proxy_serves_a_calls_first_meeting_only():
    """The streams wait for go[0] at a call's first meeting (the rows checked there), and
    for each other's arrivals after it: the proxies see them in the page every rank maps."""
    every = ranks(3, streams_meet=True)
    ids = [r.proxy.submit(0, 3, 2, row(10), 4, False, False, 5.0) for r in every]
    every[1].arrive(1, 7)
    assert every[0].arrival(1, 1).value == every[2].arrival(1, 1).value == 7  # one page
    every[1].arrive(1, 0)
    for r in every:
        r.arrive(0, 1)
    wait_until(lambda: all(r.word(GO0) == 1 for r in every))
    for s in range(3):
        for k in range(2):
            if (s, k) != (0, 0):
                for r in every:
                    r.arrive(k, s + 1)
    for r, i in zip(every, ids):
        r.proxy.wait(i)  # the proxies watched every meeting
        assert r.proxy.heartbeat()["arrive1_r2"] == 3
        r.proxy.close()


def test_where_streams_meet_a_failure_writes_every_arrival_past_and_keeps_it_there():
    """A stream that waits for a peer's arrival goes on after a failure, even where its
    peer's stream writes an arrival late (a plain store, lower than the release)."""
    every = ranks(2, streams_meet=True)
    ids = [r.proxy.submit(0, 4, 2, row(10), 4, False, False, 0.3) for r in every]
    for r in every:
        r.arrive(0, 1)
    every[0].arrive(1, 1)  # rank 1's stream never reaches the second meeting
    for r, i in zip(every, ids):
        with pytest.raises(CommTimeoutError):
            r.proxy.wait(i)
    words = [every[0].arrival(r, k) for r in range(2) for k in range(2)]
    assert all(past(w.value, 4) for w in words)
    every[1].arrive(1, 2)  # late
    wait_until(lambda: all(past(w.value, 4) for w in words), 1.0)
    for r in every:
        r.proxy.close()


def test_where_streams_meet_a_peers_failure_fails_a_rank_its_release_let_through():
    """A peer that timed out wrote every arrival past (its release), so all this rank's
    waits pass: it must still fail with the peer's reason, not finish a call whose data
    never came."""
    first, second = ranks(2, streams_meet=True)
    late = second.proxy.submit(0, 4, 2, row(10), 4, False, False, 0.2)
    second.arrive(0, 1)
    with pytest.raises(CommTimeoutError, match="rank 1 timed out after 0.2 s"):
        second.proxy.wait(late)  # rank 0 has not come: rank 1 fails and releases
    i = first.proxy.submit(0, 4, 2, row(10), 4, False, False, 30.0)
    with pytest.raises(CommTimeoutError, match="rank 1 timed out after 0.2 s"):
        first.proxy.wait(i)
    for r in (first, second):
        r.proxy.close()


def test_a_peer_that_never_comes_times_out_and_a_slow_stream_too():
    every = ranks(2)
    i = every[0].proxy.submit(0, 1, 1, row(10), 4, False, True, 0.2)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match="timed out after 0.2 s .* waiting for rank 1"):
        every[0].proxy.rows(i)
    assert time.monotonic() - start < 2
    other = ranks(2)
    i = other[0].proxy.submit(0, 1, 1, row(10), 4, False, False, 0.2)
    with pytest.raises(CommTimeoutError, match="its stream did not reach step 0"):
        other[0].proxy.wait(i)
    meeting = ranks(2, streams_meet=True)  # a peer's stream does not come
    i = meeting[0].proxy.submit(0, 2, 1, row(10), 4, False, False, 0.2)
    meeting[1].proxy.submit(0, 2, 1, row(10), 4, False, False, 30.0)
    for r in meeting:
        r.arrive(0, 1)
    meeting[0].arrive(0, 2)
    with pytest.raises(CommTimeoutError, match="waiting for rank 1 .*its stream 1 step"):
        meeting[0].proxy.wait(i)
    for r in every + other + meeting:
        r.proxy.close()


def test_a_dead_peer_fails_the_call_at_once():
    first = Rank(0, 2)
    child = subprocess.Popen([sys.executable, "-c", (
        "import ctypes, os, signal, sys; from commlib import _C\n"
        "m = (ctypes.c_uint8 * 320)()\n"
        f"p = _C.GpuProxy(1, 2, {first.proxy.channel!r}, False, "
        "[ctypes.addressof(m) + 64 * k for k in range(5)], 0, False)\n"
        "print('open', flush=True); sys.stdin.readline(); os.kill(os.getpid(), signal.SIGKILL)")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "open"
    first.proxy.unlink()
    i = first.proxy.submit(0, 1, 1, row(10), 4, False, True, 30.0)
    child.stdin.write("die\n")
    child.stdin.flush()
    child.wait()
    start = time.monotonic()
    with pytest.raises(CommError, match=f"rank 1 \\(pid {child.pid}\\) has exited"):
        first.proxy.rows(i)
    assert time.monotonic() - start < 2
    first.proxy.close()


def test_close_fails_what_waits_and_releases_it():
    every = ranks(2)
    i = every[0].proxy.submit(0, 2, 1, row(10), 4, False, False, 0.0)  # no timeout
    failed = []
    waiter = threading.Thread(target=lambda: failed.append(_raises(every[0].proxy.wait, i)))
    waiter.start()
    time.sleep(0.1)
    every[0].proxy.close()
    waiter.join(5)
    assert failed and "freed" in failed[0] and past(every[0].word(GO0), 2)
    every[1].proxy.close()


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except CommError as e:
        return str(e)
    return ""

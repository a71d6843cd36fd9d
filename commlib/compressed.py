"""Compressed collectives: float32 data carried in a wire format of fewer bytes
(csrc/wire.h), summed in float32 at every step, never in the wire format, with error
feedback.

    wire      Wire(format, block): how the elements travel. "bf16", "fp16": 2 bytes each,
              rounded to nearest-even; "int8", "fp8_e4m3", "fp8_e5m2": 1 byte each and a
              float32 scale per block of 32, 64, 128 or 256 elements (the MX idea).
    feedback  ErrorFeedback: what encoding lost, one per tensor, held by the caller and
              added to that tensor's next call: a worker residual (this rank's data as it
              sent them) and, for all_reduce, a server residual (the part this rank sums
              and sends back), as DeepSpeed's 1-bit Adam keeps both. state_dict() and
              load_state_dict() carry them through a checkpoint; reset() forgets them.

    all_reduce      rank j's part of every rank's data goes to rank j encoded (all_to_all
                    of packets); rank j decodes and sums them in rank order in float32 and
                    encodes the sum (one pass: Wire.sum_encode), and every rank gathers
                    and decodes every part (all_gather of packets): 2 (n-1)/n of the
                    packed bytes a rank, as a ring's reduce-scatter and all-gather send
                    of the float32 ones. Every rank decodes the same packets: the
                    results are equal bit for bit, and the same from run to run
                    (deterministic mode's promise holds). The data go in pieces (PIECE
                    elements), pipelined: one piece is encoded or decoded while the one
                    before it is on the wire.
    reduce_scatter  the first half: rank j's output is its block's float32 sum.
    all_gather      each rank's encoded input, gathered and decoded.

The sums are exact float32 sums of the decoded values; what a format loses is its
rounding of each rank's data and (all_reduce) of the sum sent back. Ops: sum and avg.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _C, compressed_device, compressed_pipeline
from .wire import (BLOCKS, FORMATS, PIECE, SCALED, ErrorFeedback, Wire, as_wire,  # noqa: F401
                   cut_pieces, reduce_factor, server_residual)

class Background:
    """Compressed calls on one thread of their own, in the order submitted, so that the
    caller computes while they are on the wire (they are made of blocking collectives).
    Nothing else may call their communicator meanwhile: give them one of their own
    (Communicator.dup), for calls on two threads would meet their peers in either order."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="commlib-compressed")

    def submit(self, fn, *args, **kwargs) -> "Submitted":
        return Submitted(self._pool.submit(fn, *args, **kwargs))


class Submitted:
    """A call on a Background's thread: wait() returns its result or raises its error."""

    def __init__(self, future):
        self.future = future

    def wait(self, timeout: float | None = None):
        return self.future.result(timeout)


def all_reduce(comm, data, wire, feedback: ErrorFeedback | None = None, op: str = "sum",
               piece: int = PIECE):
    """Sum (or average) ``data`` (float32, in place) over ``comm``'s ranks, carried as
    ``wire``. Returns ``data``. The data go in pieces of ``piece`` elements, pipelined:
    while one piece's packets are on the wire (the exchange and gather, async calls in the
    same order on every rank), the next is encoded and the one before decoded."""
    if compressed_device.on_device(data):
        return compressed_device.all_reduce(comm, data, wire, feedback, op, piece)
    wire, buf, factor = as_wire(wire), _float32(data, "all_reduce"), reduce_factor(op, comm.size)
    n, rank = comm.size, comm.rank
    pieces = cut_pieces(buf.size, piece)
    if n == 1:  # (nothing crosses a wire)
        return data
    worker = feedback and feedback.residual("worker", buf.size, "all_reduce")
    server, server_at = server_residual(feedback, pieces, n, rank)
    compressed_pipeline.all_reduce(comm, wire, pieces, HostCodec(wire, buf, worker), server,
                                   server_at, factor)
    return data


def reduce_scatter(comm, output, input, wire, feedback: ErrorFeedback | None = None,
                   op: str = "sum"):
    """output (float32, n elements) <- the sum (or average) over the ranks of block
    ``rank`` of their ``input`` (n x size elements), carried as ``wire``."""
    if compressed_device.on_device(output):
        return compressed_device.reduce_scatter(comm, output, input, wire, feedback, op)
    wire, factor, n = as_wire(wire), reduce_factor(op, comm.size), comm.size
    inp, out = _whole_and_block(input, output, n, "reduce_scatter", "input", "output")
    blocks = [(j * out.size, out.size) for j in range(n)]
    send, size = _encode_parts(wire, inp, blocks, feedback and feedback.residual(
        "worker", inp.size, "reduce_scatter"))
    got = np.empty(n * size, np.uint8)
    comm.all_to_all(got, send)
    wire.decode_sum(out, [got.ctypes.data + i * size for i in range(n)], factor)
    return output


def all_gather(comm, output, input, wire, feedback: ErrorFeedback | None = None):
    """output (float32, n x size elements) <- every rank's ``input``, carried as ``wire``
    (each rank's own block too: every rank holds the same values)."""
    if compressed_device.on_device(output):
        return compressed_device.all_gather(comm, output, input, wire, feedback)
    wire, n = as_wire(wire), comm.size
    out, inp = _whole_and_block(output, input, n, "all_gather", "output", "input")
    worker = feedback and feedback.residual("worker", inp.size, "all_gather")
    packet = wire.encode(inp, worker)
    gathered = np.empty(n * packet.size, np.uint8)
    comm.all_gather(gathered, packet)
    for j in range(n):
        wire.decode_sum(out[j * inp.size:(j + 1) * inp.size],
                        [gathered.ctypes.data + j * packet.size])
    return output


class HostCodec:
    """all_reduce's pieces of ``buf`` (float32 in host memory) encoded with the worker
    residual and decoded in place (commlib/compressed_pipeline.py)."""

    def __init__(self, wire: Wire, buf: np.ndarray, worker):
        self.wire, self.buf, self.worker = wire, buf, worker

    def encode(self, start: int, count: int, cut: list) -> tuple:
        return _encode_parts(self.wire, self.buf[start:start + count], cut,
                             None if self.worker is None else
                             self.worker[start:start + count])

    def decode(self, start: int, cut: list, width: int, gathered: np.ndarray) -> None:
        for j, (at, count) in enumerate(cut):
            if count:
                self.wire.decode_sum(self.buf[start + at:start + at + count],
                                     [gathered.ctypes.data + j * width])


def _encode_parts(wire: Wire, buf: np.ndarray, parts: list, residual) -> tuple:
    """(every part's packet, one after the other ``width`` bytes apart; ``width``):
    ``parts`` (start, count) of ``buf`` encoded each on its own, with ``residual``'s same
    parts. Parts that differ by an element at most are sent as equal packets (a few bytes
    of padding): all_to_all's equal form, MPI's progressed by commlib's proxy, where its
    uneven one is polled from the caller's thread (in naps, off the main thread)."""
    width = max(wire.packet_bytes(count) for _, count in parts)
    packets = np.zeros(len(parts) * width, np.uint8)
    for j, (start, count) in enumerate(parts):
        _C.wire_encode(buf.ctypes.data + 4 * start,
                       0 if residual is None else residual.ctypes.data + 4 * start,
                       packets.ctypes.data + j * width, count, wire.code, wire.block)
    return packets, width


def _whole_and_block(whole, block, n: int, what: str, whole_name: str, block_name: str):
    """The two operands as float32 views (``block`` is written only by reduce_scatter),
    ``whole`` holding ``n`` x ``block``'s elements."""
    whole = _float32(whole, what, writable=whole_name == "output")
    block = _float32(block, what, writable=block_name == "output")
    if whole.size != n * block.size:
        raise ValueError(f"compressed {what}: {whole_name} has {whole.size} elements, "
                         f"needs {n} x the {block_name}'s {block.size}")
    return whole, block


def _float32(data, what: str, writable: bool = True) -> np.ndarray:
    """``data`` (a numpy array or a CPU torch tensor) as a flat float32 numpy view."""
    if hasattr(data, "detach") and hasattr(data, "numpy"):  # torch (GPU data went to
        data = data.detach().numpy()                         # compressed_device)
    if not isinstance(data, np.ndarray):
        raise TypeError(f"compressed {what} takes a numpy array or a CPU torch tensor, "
                        f"not {type(data).__name__}")
    if data.dtype != np.float32:
        raise TypeError(f"compressed {what} takes float32 data, not {data.dtype}: the wire "
                        f"formats carry float32 (cast it, or call the uncompressed "
                        f"collective)")
    if not data.flags.c_contiguous:
        raise ValueError(f"compressed {what} needs contiguous data (np.ascontiguousarray)")
    if writable and not data.flags.writeable:
        raise ValueError(f"compressed {what} writes its result into a read-only array")
    return data.reshape(-1)

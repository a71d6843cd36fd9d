"""What compressed collectives carry and keep (commlib/compressed.py on CPU data,
commlib/compressed_device.py on GPU data): a wire format (csrc/wire.h's packets, on the CPU;
commlib/cuda/wire.cu's, the same bits, on the GPU), the residuals of error feedback, and
how a call cuts its data into the ranks' parts and exchanges them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _C

FORMATS = dict(_C.WIRE_FORMATS)  # name -> code (csrc/wire.h)
SCALED = frozenset({"int8", "fp8_e4m3", "fp8_e5m2"})
BLOCKS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Wire:
    """A wire format: ``format`` (FORMATS) and, for the scaled ones, ``block`` elements
    per float32 scale."""
    format: str
    block: int = 64

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown wire format {self.format!r}; known: "
                             f"{', '.join(FORMATS)}")
        if self.format in SCALED and self.block not in BLOCKS:
            raise ValueError(f"{self.format} takes a block of {', '.join(map(str, BLOCKS))} "
                             f"elements per scale, not {self.block!r}")

    @property
    def code(self) -> int:
        return FORMATS[self.format]

    def packet_bytes(self, count: int) -> int:
        """Bytes of ``count`` elements in this format, scales included."""
        return _C.wire_packet_bytes(self.code, count, self.block)

    def encode(self, data: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
        """``data`` (float32) as a packet; with ``residual``, data + residual is encoded
        and the residual becomes what the packet lost."""
        packet = np.empty(self.packet_bytes(data.size), np.uint8)
        _C.wire_encode(data.ctypes.data, 0 if residual is None else residual.ctypes.data,
                       packet.ctypes.data, data.size, self.code, self.block)
        return packet

    def decode_sum(self, out: np.ndarray, packets: list, factor: float = 1.0) -> None:
        """``out`` (float32) <- ``factor`` x the sum of ``packets`` (addresses of packets
        of out.size elements), in their order."""
        _C.wire_decode_sum(out.ctypes.data, packets, out.size, self.code, self.block, factor)


    def sum_encode(self, packet: np.ndarray, packets: list, count: int,
                   residual: np.ndarray | None = None, factor: float = 1.0) -> None:
        """``packet`` <- ``factor`` x the sum of ``packets`` (addresses of packets of
        ``count`` elements) (+ ``residual``, which becomes what the packet lost), encoded:
        a reducing step's decode, add and encode in one pass."""
        _C.wire_sum_encode(packet.ctypes.data, 0 if residual is None else
                           residual.ctypes.data, packets, count, self.code, self.block, factor)


def as_wire(wire) -> Wire:
    """A Wire, from one or its format's name."""
    return wire if isinstance(wire, Wire) else Wire(wire)


class ErrorFeedback:
    """What a tensor's compressed calls lost, added to its next call (one per tensor).
    Each residual is a float32 numpy array, or, after a call on GPU data, a
    compressed_device.DeviceResidual (kept on the device; ``copy()`` gives its host copy,
    which state_dict() holds)."""

    def __init__(self):
        self.worker: np.ndarray | None = None  # this rank's data, as encoded
        self.server: np.ndarray | None = None  # the part this rank sums and sends back

    def reset(self) -> None:
        self.worker = self.server = None

    def state_dict(self) -> dict:
        return {k: None if v is None else v.copy()
                for k, v in (("worker", self.worker), ("server", self.server))}

    def load_state_dict(self, state: dict) -> None:
        for name in ("worker", "server"):
            value = state.get(name)
            setattr(self, name, None if value is None else
                    np.ascontiguousarray(value, np.float32).copy())

    def residual(self, name: str, count: int, what: str) -> np.ndarray:
        """The ``name`` residual for ``count`` elements (zeros at first), in host memory
        (one a GPU call kept on its device comes back, as compressed_device keeps them)."""
        held = getattr(self, name)
        if held is not None and not isinstance(held, np.ndarray):
            held = held.copy()  # (compressed_device.DeviceResidual: its host copy)
            setattr(self, name, held)
        if held is None:
            held = np.zeros(count, np.float32)
            setattr(self, name, held)
        elif held.dtype != np.float32 or held.size != count:
            raise ValueError(f"{what}: this ErrorFeedback holds a {name} residual of "
                             f"{held.size} {held.dtype} elements, the call needs {count} "
                             f"float32: keep one ErrorFeedback per tensor (or reset() it)")
        return held


def exchange_algorithm(comm) -> str | None:
    """all_reduce's exchange: pairwise where the communicator has it. The exchange runs
    beside the caller's compute; MPI's own all_to_all moves bytes only while it is
    polled, and its poller naps there (2 hosts at 1 Gbit/s, 25M int8 elements: 646 ms
    with auto's MPI, 317 ms pairwise; pipelined 233 and 224, bf16 660 and 424, the wire's
    floor 214 and 403). The same on every rank: the call's own properties decide it."""
    return "pairwise" if "pairwise" in comm.algorithms("all_to_all") else None


def parts(count: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(count, n)
    return [(i * base + min(i, extra), base + (i < extra)) for i in range(n)]


def reduce_factor(op: str, n: int) -> float:
    if op == "sum":
        return 1.0
    if op == "avg":
        return 1.0 / n
    raise ValueError(f"compressed collectives sum or average: op {op!r} cannot be "
                     f"compressed; call the uncompressed collective for it")


PIECE = 1 << 20  # elements all_reduce carries a piece at a time (4 MiB of float32)


def cut_pieces(count: int, piece: int) -> list[tuple[int, int]]:
    """all_reduce's pieces (start, count) of ``piece`` elements."""
    if not isinstance(piece, int) or piece < 1:
        raise ValueError(f"compressed all_reduce: piece={piece!r}; give a positive number "
                         f"of elements")
    return [(start, min(piece, count - start)) for start in range(0, count, piece)]


def server_residual(feedback: ErrorFeedback | None, pieces: list, n: int, rank: int):
    """all_reduce's server residual (this rank's part of each piece, one after the other;
    None without feedback) and where each piece's part starts in it."""
    owned = [parts(count, n)[rank][1] for _, count in pieces]
    at = np.cumsum([0] + owned)
    return (feedback and feedback.residual("server", int(at[-1]), "all_reduce")), at

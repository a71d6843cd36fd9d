"""An agreement's row: what every rank sends every other to check a call (transports/mpi.py's
Agreement, transports/gloo.py's agree), in int64 words: the call's descriptor (8 words), the
bytes all_to_all sends to and receives from each peer (2 words a rank), then the data the
eager algorithm carries (algorithms/eager.py), at most the payload's bytes. Here, where the
transports that send rows and the costs of what rides in them both read it.
"""


def header_words(size: int) -> int:
    """The descriptor's and all_to_all's words before the payload, among ``size`` ranks."""
    return 8 + 2 * size


def mpi_payload_bytes(size: int) -> int:
    """Over MPI: 1 MiB per row, less where the ranks are many (the rows take at most 4 MiB)."""
    return max(4096, min(1 << 20, (4 << 20) // size)) // 8 * 8


def gloo_payload_bytes(size: int) -> int:
    """Over gloo: 4 KiB, less among many ranks (every call's agreement sends a whole row to
    every peer, an all-gather of fixed length)."""
    return max(256, min(4096, (64 << 10) // size)) // 8 * 8


def gloo_row_bytes(size: int) -> int:
    """A whole row over gloo, as every agreement there sends it."""
    return 8 * header_words(size) + gloo_payload_bytes(size)

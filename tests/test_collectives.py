"""commlib/collectives.py's table (read from csrc/agreement.h's kCollectives) says what
the call rules of csrc/call.cpp enforce, collective by collective."""
import numpy as np
import pytest

from commlib import _C
from commlib.collectives import COLLECTIVES, REDUCING, ROOTED, TABLE, of

N, RANK, SUM = 3, 1, _C.OPS["sum"]
F32 = _C.DTYPES["float32"]


def _check(kind, out, inp, op=SUM, root=0):
    return _C.check_call(kind.code, N, RANK, out.ctypes.data, out.size, F32,
                         *((inp.ctypes.data, inp.size, F32) if inp is not None else (0, 0, -1)),
                         op if kind.reduces else _C.NONE, root if kind.rooted else _C.NONE)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_the_call_rules_hold_what_the_table_says(name):
    kind = of(name)
    block = np.zeros(4, np.float32)
    whole = np.zeros(4 * N, np.float32)
    out, inp = {"in_place": (whole, None), "scatter": (block, whole),
                "gather": (whole, block), "exchange": (whole, whole.copy())}[kind.parts]
    _check(kind, out, inp)  # as the table says: accepted
    if kind.parts in ("scatter", "gather"):  # a block of the wrong size: refused
        with pytest.raises(ValueError):
            _check(kind, *((block, block) if kind.parts == "scatter" else (block, whole)))
    if kind.rooted:
        with pytest.raises(ValueError, match="root=3 is outside"):
            _check(kind, out, inp, root=N)
    if kind.reduces:
        with pytest.raises(ValueError, match="unknown reduce op"):
            _check(kind, out, inp, op=1000)
    assert kind.has_input == (inp is not None) and kind.in_place == (inp is None)
    assert (name in REDUCING, name in ROOTED) == (kind.reduces, kind.rooted)


def test_every_code_of_the_extension_has_a_row():
    assert {c.code for c in TABLE.values()} == set(_C.COLLECTIVES.values())
    assert {c.name for c in TABLE.values() if c.parts != "none"} == set(COLLECTIVES)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'; known: all_reduce"):
        of("allreduce")

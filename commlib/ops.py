"""Reduction operators."""
from enum import Enum


class ReduceOp(str, Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"  # reduces as sum, then scaled by 1/size; floating dtypes only

    @classmethod
    def parse(cls, op, dtype=None) -> "ReduceOp":
        """Accept a ReduceOp or its name (any case); refuse avg on integer dtypes."""
        parsed = _BY_NAME.get(op) if isinstance(op, str) else None  # also ReduceOp itself
        if parsed is None:
            parsed = op if isinstance(op, cls) else _BY_NAME.get(str(op).lower())
        if parsed is None:
            raise ValueError(f"unknown reduce op {op!r}; valid: "
                             f"{', '.join(o.value for o in cls)}")
        if parsed is cls.AVG and dtype is not None and not dtype.floating:
            raise ValueError(f"op 'avg' needs a floating dtype, got {dtype.name}; "
                             "use 'sum' and divide, or convert to a float type first")
        return parsed



_BY_NAME = {o.value: o for o in ReduceOp}

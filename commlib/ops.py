"""Reduction operators."""
from enum import Enum


class ReduceOp(str, Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"  # reduces as sum, then scaled by 1/size; floating dtypes only

    @classmethod
    def parse(cls, op) -> "ReduceOp":
        """Accept a ReduceOp or its name (any case)."""
        parsed = _BY_NAME.get(op) if isinstance(op, str) else None  # also ReduceOp itself
        if parsed is None:
            parsed = op if isinstance(op, cls) else _BY_NAME.get(str(op).lower())
        if parsed is None:
            raise ValueError(f"unknown reduce op {op!r}; valid: "
                             f"{', '.join(o.value for o in cls)}")
        return parsed


_BY_NAME = {o.value: o for o in ReduceOp}

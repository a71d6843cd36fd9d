"""The algorithm registry: every algorithm of every collective, what it needs, what it costs.

An entry is a *schedule* (``build(size, rank, count, itemsize, **params)``, run by the
transport's executor; count: the call's primary count) or a *runner* (``run(transport,
call)``). It says what it needs (a capability a transport offers: NEEDS), the memory it
works on ("host": GPU arrays are staged through host memory for it; "device"), and its
cost: ``cost(model, where, n, nbytes)``, terms linear in select.CostModel's constants for
n ranks and the primary buffer's bytes at ``where`` (transports/base.py's Where: what the
transport says its costs depend on). select.py picks the cheapest.
"""
from .registry import (NEEDS, Algorithm, algorithms, candidates, entries, get,  # noqa: F401
                       log2_rounds, register, schedule, unavailable)
from ..collectives import COLLECTIVES  # noqa: F401,I001  (as the registry names them)
from . import (direct, eager, gloo, hier, ipc, native, one_copy, ordered, pairwise,  # noqa: E402,F401,I001  (register themselves)
               rhd, ring, tree)

"""What the benchmarks read of commlib beyond its public API, in one place, each with why
(tests/test_layers.py holds every other module of commlib_bench to the public API).
"""
# the kernels and the copy bound timed as they are, without a call around them
# (commlib-bench kernels; compare's copy bandwidth)
from commlib import _C  # noqa: F401
# calibrate fits the cost model's constants to every registry entry's terms, priced at a
# transport's Where, and writes the tuning file the choice reads
from commlib.algorithms import COLLECTIVES, entries, get as algorithm_entry  # noqa: F401
# whether a buffer lies on memory every rank maps: the peers time one_copy there
from commlib.algorithms.pages import mapped  # noqa: F401
from commlib.select import CostModel, default_model, tuning_path  # noqa: F401
from commlib.transports.base import Where  # noqa: F401

"""Transports: what a communicator's calls run over, one module each (mpi, shm, hosts,
store, gloo, cuda_ipc; each module's header says what it is), behind base.Transport's interface.

A new transport is a module here with a Transport subclass, and its name below. ``auto``
takes the first of PREFERENCE whose ``suits(world)`` holds for an MPI communicator's
world (transports/mpi_world.py); COMMLIB_TRANSPORT names one instead.
"""
from __future__ import annotations

import importlib

from .. import settings

# name -> (module, class): imported on first use, so that importing commlib loads no CUDA
TRANSPORTS = {"mpi": ("mpi", "MpiTransport"), "shm": ("shm", "ShmTransport"),
              "hosts": ("hosts", "HostsTransport"), "store": ("store", "StoreTransport"),
              "gloo": ("gloo", "GlooTransport"), "cuda_ipc": ("cuda_ipc", "CudaIpc"),
              "net": ("net", "NetTransport"), "gloo_hosts": ("gloo", "GlooHostsTransport")}
PREFERENCE = ("shm", "hosts", "net", "mpi")


def load(name: str):
    """The transport class registered as ``name``."""
    module, cls = TRANSPORTS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def pick(world):
    """The transport of a new communicator over an MpiWorld (transports/mpi.py):
    COMMLIB_TRANSPORT's, else the first of PREFERENCE that suits its hosts. Collective."""
    requested = settings.get("COMMLIB_TRANSPORT")
    if requested not in ("auto", *PREFERENCE):
        raise ValueError(f"COMMLIB_TRANSPORT={requested!r}; valid: auto, "
                         f"{', '.join(sorted(PREFERENCE))}")
    for name in PREFERENCE if requested == "auto" else (requested,):
        cls = load(name)
        if cls.suits(world):
            return cls.create(world)
    raise ValueError(f"COMMLIB_TRANSPORT={requested}, but this communicator spans "
                     f"{world.hosts[0]} hosts; use auto or mpi")

"""Deliberately hangs: both ranks wait for a message nobody sends (tests the launcher's timeout)."""
import numpy as np

import commlib

comm = commlib.init()
comm.recv(np.zeros(1), (comm.rank + 1) % comm.size)

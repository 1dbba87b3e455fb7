"""How long the engine's OpenMP threads spin at a barrier before they sleep.

libgomp (PyTorch's and the engine's kernels' OpenMP) lets a thread that waits
at a barrier spin 300,000 times before it sleeps. A worker shares its cores
with its job threads, the API, Redis and the clients: when one of the
engine's two threads is preempted, the other spins on its core for the whole
wait instead of leaving it to the preempted one. With 2,000 spins it sleeps
after a few microseconds, and the kernel moves the waiting thread onto the
freed core. Measured with ``python -m bench`` on 2 cores (SmolLM2-135M, tok/s of
the farm at 8 / 16 clients): default 188 / 205, 100,000 spins 275 / 370,
20,000 spins 314 / 326, 2,000 spins 315 / 358; the bare engine's did not
change (433 / 509 at 2,000 against 401 / 515).
"""

from __future__ import annotations

import os

SPIN_COUNT = 2000


def spin_briefly() -> None:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless the environment chose a
    policy (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``). libgomp reads it once, when
    it loads: call this before anything imports torch."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)

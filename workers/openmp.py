"""How long the engine's OpenMP threads spin at a barrier before they sleep.

libgomp (PyTorch's and the engine's kernels' OpenMP) lets a thread that waits
at a barrier spin 300,000 times before it sleeps. A worker shares its cores
with its job threads, the API, Redis and the clients: when one of the
engine's two threads is preempted, the other spins on its core for the whole
wait instead of leaving it to the preempted one. Too few spins cost the
other way: a thread that sleeps at every barrier must be woken at the next
one, and a decoding step has about 300 of them (a few per layer).

Measured with ``python -m bench`` on 2 cores (SmolLM2-135M, tok/s of the farm
at 8 / 16 clients). With the engine of 2026-11 (slower steps): default
188 / 205, 100,000 spins 275 / 370, 20,000 spins 314 / 326, 2,000 spins
315 / 358. With the panel kernels (2026-12-01, Zen 4, two runs each, taken
in turn): 2,000 spins 296 / 366 and 307 / 357, 30,000 spins 347 / 407 and
329 / 382, 200,000 spins 341 / 369. With today's engine (2026-12-06, a Zen 5
EPYC, where 30,000 spins last 0.7 ms; 4 requests a client, the settings taken
in turn, medians of 7 rounds, 4 / 8 / 16 clients): 5,000 spins 661 / 929 /
1,037, 30,000 spins 636 / 873 / 1,003; 2,000 and 10,000 did no better than
5,000 (bench/README.md); on a 2026-12-07 Xeon with AMX the same A/B put
5,000 and 30,000 within the rounds' spread (506 / 614 / 676 against 488 /
632 / 701). A step's own barriers wait microseconds; the long
waits are for a partner the OS has preempted, where a spinning thread only
burns its core. On a 2026-12-05 Xeon 3,000 spins had measured below 30,000
(two runs each): ``GOMP_SPINCOUNT`` overrides the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SPIN_COUNT = 5000

_set_here = False  # whether spin_briefly, not the operator, set GOMP_SPINCOUNT


def spin_briefly() -> None:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless the environment chose a
    policy (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``). libgomp reads it once, when
    it loads: call this before anything imports torch."""
    global _set_here
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        _set_here = True


def without_our_spin(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the ``GOMP_SPINCOUNT`` that :func:`spin_briefly` set:
    for a child process that is not ours (the benchmark's llama.cpp server), which
    must run with its own OpenMP defaults, as its users run it. A value the
    operator set stays."""
    copy = dict(env)
    if _set_here and copy.get("GOMP_SPINCOUNT") == str(SPIN_COUNT):
        del copy["GOMP_SPINCOUNT"]
    return copy

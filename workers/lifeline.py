"""Child processes that die with their parent (Linux's parent death signal).

A supervisor that is killed with SIGKILL (or by the OOM killer) cannot stop its
children; without help they live on with parent 1, nobody supervising them —
an API answering ``/readyz`` for a farm with no workers, holding its port
against the next start. ``prctl(PR_SET_PDEATHSIG, sig)`` asks the kernel to
send ``sig`` to the child when the *thread* that forked it dies, so children
must be started from a thread that lives as long as the supervisor does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

# prctl(2) option: the signal a process gets when the thread that forked it dies.
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child ``sig`` when this process dies; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    signum = int(sig)

    def preexec() -> None:
        # Runs in the child between fork and exec: nothing here may take a lock.
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: too late for prctl
            os.kill(os.getpid(), signum)

    return preexec

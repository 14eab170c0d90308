"""How OpenMP threads wait, set before torch loads its OpenMP runtime.

torch runs CPU kernels on an OpenMP thread team, one thread per core. Between parallel
regions, GNU OpenMP's idle threads spin (about 300,000 iterations) before they sleep. On a
machine where another process keeps a core busy, a spinning thread competes with it for
time slices, and every parallel region then waits for the team member that the kernel
scheduler parked; the measurements in issue 21 went from 3.3 s alone to 84 s beside one
busy-loop process (39 s even at ``nice 19``). Threads that sleep as soon as they are idle
(``OMP_WAIT_POLICY=PASSIVE``) keep a low virtual runtime, so the scheduler runs them as
soon as they wake, and an oversubscribed box slows down by about the core it lost instead.

The runtime reads these variables once, when it is loaded (``import torch``), so they are
set when ``tandem`` is imported, before torch, in the process that imports it; tandem's
child processes (engine core, workers) inherit them and import tandem first too. A value
the user set explicitly is never replaced: ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` keep
GNU OpenMP's waiting as the user chose, ``KMP_BLOCKTIME`` does the same for builds that
link Intel's OpenMP. Thread counts are left alone (``OMP_NUM_THREADS`` or torch's default
of one per core): passive waiting alone removes the stall, while one thread per core fewer
(``OMP_NUM_THREADS=1`` on two cores) slowed the idle case from 3.3 s to 4.5-5.3 s.
``benchmarks/busy_neighbour.py`` measures both policies side by side.
"""
from __future__ import annotations

import os
import sys
from typing import MutableMapping

__all__ = ["WAIT_POLICY_DEFAULTS", "apply_wait_policy"]

# What tandem sets when the user set none of these.
WAIT_POLICY_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
# Any of these set by the user means they chose how GNU OpenMP waits.
_GNU_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_wait_policy(env: MutableMapping[str, str]) -> dict[str, str]:
    """Set tandem's wait policy in ``env`` where the user chose none; return what was set."""
    added: dict[str, str] = {}
    if not any(name in env for name in _GNU_WAIT_VARS):
        added["OMP_WAIT_POLICY"] = WAIT_POLICY_DEFAULTS["OMP_WAIT_POLICY"]
    if "KMP_BLOCKTIME" not in env:
        added["KMP_BLOCKTIME"] = WAIT_POLICY_DEFAULTS["KMP_BLOCKTIME"]
    env.update(added)
    return added


def apply_to_this_process() -> None:
    """``apply_wait_policy(os.environ)`` while it can still take effect (torch not loaded)."""
    if "torch" not in sys.modules:
        apply_wait_policy(os.environ)

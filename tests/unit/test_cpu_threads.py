"""tandem's OpenMP wait policy: set on import before torch loads, never over the user's choice."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.cpu_threads import WAIT_POLICY_DEFAULTS, apply_wait_policy

pytestmark = pytest.mark.timeout(120)

_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def test_defaults_fill_only_what_the_user_left_unset():
    env: dict[str, str] = {}
    assert apply_wait_policy(env) == WAIT_POLICY_DEFAULTS == env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    env = {"OMP_WAIT_POLICY": "active", "KMP_BLOCKTIME": "200"}
    assert apply_wait_policy(env) == {} and env == {"OMP_WAIT_POLICY": "active", "KMP_BLOCKTIME": "200"}
    env = {"GOMP_SPINCOUNT": "300000"}  # a spin count is a choice of how GNU OpenMP waits
    assert apply_wait_policy(env) == {"KMP_BLOCKTIME": "0"} and "OMP_WAIT_POLICY" not in env


def _env_after(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in _VARS}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=100, check=True)
    return out.stdout.strip()


def test_importing_tandem_sets_the_policy_before_torch_loads():
    show = "import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('KMP_BLOCKTIME'))"
    assert _env_after(f"import tandem; {show}") == "PASSIVE 0"
    assert _env_after(f"import tandem; {show}", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE 0"
    # torch loaded first: its OpenMP runtime has read the environment already; leave it alone
    assert _env_after(f"import torch, tandem; {show}") == "None None"

"""Workers shorten OpenMP's spinning unless the environment chose a policy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers.openmp import SPIN_COUNT, spin_briefly, without_our_spin


def test_sets_the_spin_count_only_where_no_policy_was_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spin_briefly()
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    spin_briefly()
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    spin_briefly()
    assert os.environ["GOMP_SPINCOUNT"] == "5"


def test_a_foreign_child_gets_the_environment_without_our_spin_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The benchmark's llama.cpp server runs with libgomp's own default, not the
    worker's setting; a value the operator chose is passed on."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spin_briefly()
    child = without_our_spin(os.environ)
    assert "GOMP_SPINCOUNT" not in child
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)  # this process keeps it
    assert child["PATH"] == os.environ["PATH"]
    monkeypatch.setenv("GOMP_SPINCOUNT", "12345")
    assert without_our_spin(os.environ)["GOMP_SPINCOUNT"] == "12345"


@pytest.mark.parametrize("package", ["cli", "workers"])
def test_a_worker_process_sets_it_before_torch_is_imported(package: str) -> None:
    """``python -m cli`` sets it first: torch is not yet loaded when it does (and
    ``python -m workers``, its old name, runs the same)."""
    code = (
        f"import runpy, sys; sys.argv = ['{package}', '--help'];"
        "import workers.openmp as o; before = o.spin_briefly;"
        "calls = [];"
        "o.spin_briefly = lambda: calls.append('torch' in sys.modules) or before();"
        f"\ntry:\n    runpy.run_module('{package}', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(calls)"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip().splitlines()[-1] == "[False]", out.stdout + out.stderr

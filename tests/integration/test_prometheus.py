"""The monitoring profile's Prometheus config and Grafana dashboard, against a real farm.

``docker compose --profile monitoring`` runs Prometheus with docker/prometheus.yml
and Grafana with docker/grafana/dashboards/switchyard.json. Docker is not needed
to check what they rely on: Debian's ``prometheus`` package (``apt-get install
prometheus``; .ci/run installs it) gives ``promtool``, which validates the shipped
config, and the server itself, which scrapes the test farm's API with the same
job and answers every query of the dashboard as Grafana would send it. A metric
renamed, a label dropped or a query that does not parse fails here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests import farm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docker" / "prometheus.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "switchyard.json"
MODEL = "tiny-random"

# Series a finished job of the tiny-random model must have given the dashboard
# (others, such as re-runs or desired replicas without a scaler, may rightly be empty).
MUST_HAVE_DATA = (
    "switchyard_queue_depth",
    "switchyard_jobs_running",
    "switchyard_replicas_ready",
    "switchyard_generated_tokens_total",
    "switchyard_time_to_first_token_seconds_bucket",
    "switchyard_queue_wait_seconds_bucket",
    "switchyard_jobs_finished_total",
    "switchyard_inter_token_latency_seconds_bucket",
    "switchyard_http_requests_total",
    "switchyard_workers",
)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install prometheus (.ci/run does)")
    return path


def test_the_shipped_prometheus_config_is_valid() -> None:
    done = subprocess.run(
        [_binary("promtool"), "check", "config", str(CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def prometheus(api_url: str, tmp_path: Path, log_dir: Path) -> Iterator[str]:
    """Prometheus scraping the test API with the shipped scrape job, every second."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [api_url.removeprefix("http://")]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = farm.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        _binary("prometheus"),
        f"--config.file={path}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with farm.serving(argv, {}, log_dir / f"prometheus-{time.time_ns()}.log", f"{url}/-/ready"):
        yield url


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    r = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _as_grafana_sends(expr: str) -> str:
    """The dashboard's query with its variables filled in as Grafana would."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$\{?model\}?", MODEL, expr)


def test_every_dashboard_query_answers_from_the_farms_metrics(
    prometheus: str, api_url: str, user_token: str, tiny_worker: farm.Process
) -> None:
    r = requests.post(
        f"{api_url}/v1/jobs",
        json={"model": MODEL, "prompt": "Hello", "params": {"max_new_tokens": 8}},
        headers={"Authorization": f"Bearer {user_token}"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    assert farm.wait_final(api_url, user_token, r.json()["id"])["status"] == "succeeded"

    dashboard = json.loads(DASHBOARD.read_text())
    targets = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert targets, "the dashboard has no queries"
    used = {name for expr in targets for name in re.findall(r"switchyard_\w+", expr)}
    missing = set(MUST_HAVE_DATA) - used
    assert not missing, f"the dashboard no longer shows {missing}"

    # The finished job has been scraped, twice at least, so rates have two points.
    finished = f'switchyard_jobs_finished_total{{model="{MODEL}"}}'
    farm.wait_for(
        "Prometheus to scrape the finished job",
        lambda: _query(prometheus, f"count_over_time({finished}[1m]) >= 2"),
        timeout=60,
        every=1,
    )

    # The model variable's own query lists the model.
    variable = dashboard["templating"]["list"][0]
    match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"])
    assert match, variable
    values = requests.get(
        f"{prometheus}/api/v1/label/{match[2]}/values",
        params={"match[]": match[1]},
        timeout=30,
    ).json()
    assert MODEL in values["data"], values

    empty = []
    for expr in targets:
        result = _query(prometheus, _as_grafana_sends(expr))
        if not result and any(name in expr for name in MUST_HAVE_DATA):
            empty.append(expr)
    assert not empty, f"dashboard queries without data after a finished job: {empty}"

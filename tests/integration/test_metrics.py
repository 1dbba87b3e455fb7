"""``/metrics`` under gunicorn with two worker processes: the numbers add up across them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests
from prometheus_client.parser import text_string_to_metric_families

from config import Settings
from jobs import metrics as m
from jobs.metrics import FLUSH_INTERVAL_S, MetricsBuffer, MetricsStore
from tests import farm

MODEL = "tiny-random"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    r = requests.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def gunicorn_url(migrated: Settings, log_dir: Path) -> Iterator[str]:
    assert migrated.api_workers == 2
    with farm.serve_gunicorn(migrated, log_dir) as url:
        yield url


def test_metrics_count_jobs_tokens_latencies_and_requests_across_processes(
    gunicorn_url: str, user_token: str, migrated: Settings, tiny_worker: farm.Process
) -> None:
    url = gunicorn_url
    before = scrape(url)
    headers = {"Authorization": f"Bearer {user_token}"}
    jobs = []
    for n in (5, 9, 13):
        body = {"model": MODEL, "prompt": "Once upon a time", "params": {"max_new_tokens": n}}
        r = requests.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=30)
        assert r.status_code == 202, r.text
        jobs.append(r.json()["id"])
    finals = [farm.wait_final(url, user_token, j) for j in jobs]
    assert all(j["status"] == "succeeded" for j in finals)
    generated = sum(j["usage"]["completion_tokens"] for j in finals)
    prompt = sum(j["usage"]["prompt_tokens"] for j in finals)

    # New connections each time: gunicorn's two processes share the requests.
    for _ in range(20):
        assert requests.get(f"{url}/v1/models", timeout=30).status_code == 200
    for _ in range(3):
        assert requests.get(f"{url}/v1/jobs/nope", headers=headers, timeout=30).status_code == 404

    # Whichever process answers the scrape, it reports the farm-wide totals: each
    # process writes its requests' counters within FLUSH_INTERVAL_S.
    time.sleep(2 * FLUSH_INTERVAL_S)
    scrapes = [scrape(url) for _ in range(6)]
    after = scrapes[0]

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for s in scrapes[1:]:
        for name, labels in [
            ("switchyard_http_requests_total", {"route": "/v1/models", "method": "GET"}),
            ("switchyard_generated_tokens_total", {"model": MODEL}),
        ]:
            full = {**labels, "status": "200"} if "route" in labels else labels
            assert value(s, name, **full) == value(after, name, **full)

    m = {"model": MODEL}
    assert (
        delta("switchyard_http_requests_total", route="/v1/models", method="GET", status="200")
        == 20
    )
    assert (
        delta(
            "switchyard_http_requests_total", route="/v1/jobs/<job_id>", method="GET", status="404"
        )
        == 3
    )
    assert (
        delta("switchyard_http_request_duration_seconds_count", route="/v1/models", method="GET")
        == 20
    )
    assert delta("switchyard_jobs", status="succeeded", **m) == 3
    assert delta("switchyard_jobs_finished_total", status="succeeded", **m) == 3
    assert delta("switchyard_generated_tokens_total", **m) == generated == 5 + 9 + 13
    assert delta("switchyard_prompt_tokens_total", **m) == prompt
    assert delta("switchyard_time_to_first_token_seconds_count", **m) == 3
    assert delta("switchyard_e2e_latency_seconds_count", **m) == 3
    assert delta("switchyard_queue_wait_seconds_count", **m) == 3
    itl = delta("switchyard_inter_token_latency_seconds_count", **m)
    assert 0 < itl <= generated - 3
    assert delta("switchyard_e2e_latency_seconds_sum", **m) > 0
    bucket = value(after, "switchyard_e2e_latency_seconds_bucket", le="+Inf", **m)
    assert bucket == value(after, "switchyard_e2e_latency_seconds_count", **m)

    assert value(after, "switchyard_queue_depth", **m) == 0
    assert value(after, "switchyard_jobs_running", **m) == 0
    assert value(after, "switchyard_replicas_ready", **m) == 1
    assert value(after, "switchyard_workers", status="ready", **m) == 1
    client = redis.Redis.from_url(migrated.redis_url)
    published = client.hget(migrated.key("scaling", "desired"), MODEL)
    expected = json.loads(published)["desired"] if published else 0  # tiny-random: min 0
    assert value(after, "switchyard_replicas_desired", **m) == expected
    ages = [
        v
        for (name, labels), v in after.items()
        if name == "switchyard_worker_heartbeat_age_seconds"
        and dict(labels)["model"] == MODEL
        and dict(labels)["status"] == "ready"
    ]
    assert len(ages) == 1 and 0 <= ages[0] < migrated.heartbeat_ttl_s


def test_a_metrics_buffer_writes_its_batches_sums_together_within_its_interval(
    migrated: Settings,
) -> None:
    client = redis.Redis.from_url(migrated.redis_url)
    store = MetricsStore(client, migrated)
    labels = {"route": "/buffer-test", "method": "GET", "status": "200"}
    key, field = store.key(m.HTTP_REQUESTS.name), store.field(m.HTTP_REQUESTS.labels, labels)

    def stored() -> int:
        return int(client.hget(key, field) or 0)

    def commit(buffer: MetricsBuffer, n: int) -> None:
        for _ in range(n):
            batch = buffer.batch()
            batch.inc(m.HTTP_REQUESTS, labels)
            batch.commit()

    start = stored()
    slow = MetricsBuffer(store, interval_s=60)
    commit(slow, 5)
    assert stored() == start  # gathered in the process, not written per batch
    slow.flush()
    assert stored() == start + 5  # one write, the five batches summed
    commit(slow, 2)
    slow.stop()
    assert stored() == start + 7  # stopping writes what is left

    fast = MetricsBuffer(store, interval_s=0.1)
    commit(fast, 3)
    deadline = time.monotonic() + 5
    while stored() < start + 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stored() == start + 10  # its thread wrote them without a flush
    fast.stop()

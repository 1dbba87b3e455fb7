"""``GET /metrics``: the farm in Prometheus' text format, and the API's request metrics.

Two sources, both correct across gunicorn processes, API replicas and worker
hosts without ``PROMETHEUS_MULTIPROC_DIR``:

* gauges of the current state, computed at scrape time — jobs per model and
  status and the queue depth from Postgres, replicas and heartbeat ages from
  the worker registry, desired replicas from the scaler, waiting broker
  messages from Redis;
* counters and histograms every process adds to in Redis
  (:mod:`jobs.metrics`) — tokens, time to first token, inter-token latency,
  end-to-end latency, queue wait, restarts, and the API's requests by route
  template, method and status (recorded here, per request, and written by
  each process once a second: :class:`jobs.metrics.MetricsBuffer`).

Every series is farm-wide: scrape one API replica (or the service address),
not each one. The route is unauthenticated by default, like most exporters;
keep it on the internal network, or set ``metrics_token_required`` and give the
scraper an operator's token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from flask import Blueprint, Flask, Response, g, request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from api.auth import OPERATORS, require_role
from api.services import Services, services
from fleet.capacity import fleet, worker_status
from fleet.registry import list_workers
from jobs import metrics as m
from jobs.messages import BrokerView
from jobs.metrics import MetricsStore

bp = Blueprint("metrics", __name__)

WORKER_STATES = ("starting", "ready", "draining", "failed", "lost")
JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
_START = "_switchyard_request_started"


def _name(short: str) -> str:
    return f"{m.NAMESPACE}_{short}"


class FarmCollector:
    """Yields every Switchyard metric family for one scrape."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        yield from self._state_gauges()
        yield from self._stored()

    def _state_gauges(self) -> Iterator[Metric]:
        svc = self.svc
        workers = list_workers(svc.redis, svc.settings)
        capacity = fleet(svc.catalog, svc.jobs, svc.redis, svc.settings, workers)
        by_status = svc.jobs.status_counts()
        broker = BrokerView(svc.redis, svc.settings)

        jobs = GaugeMetricFamily(
            _name("jobs"), "Jobs in the database, per model and status.", labels=["model", "status"]
        )
        queue = GaugeMetricFamily(
            _name("queue_depth"), "Jobs queued (not yet started) per model.", labels=["model"]
        )
        running = GaugeMetricFamily(
            _name("jobs_running"), "Jobs running on a worker now.", labels=["model"]
        )
        waiting = GaugeMetricFamily(
            _name("broker_messages_waiting"),
            "Messages waiting in the model's Celery queue (the list <prefix>:gen.<model>).",
            labels=["model"],
        )
        ready = GaugeMetricFamily(
            _name("replicas_ready"), "Workers ready and alive (capacity).", labels=["model"]
        )
        starting = GaugeMetricFamily(
            _name("replicas_starting"), "Workers starting and alive.", labels=["model"]
        )
        desired = GaugeMetricFamily(
            _name("replicas_desired"),
            "Replicas the scaler wants (the definition's min_replicas until it decides).",
            labels=["model"],
        )
        for c in capacity:
            statuses = by_status.get(c.model, {})
            for status in JOB_STATES:
                jobs.add_metric([c.model, status], statuses.get(status, 0))
            queue.add_metric([c.model], c.queued)
            running.add_metric([c.model], c.running)
            waiting.add_metric([c.model], broker.waiting(c.model))
            ready.add_metric([c.model], c.ready)
            starting.add_metric([c.model], c.starting)
            desired.add_metric([c.model], c.desired)
        yield from (jobs, queue, running, waiting, ready, starting, desired)

        count = GaugeMetricFamily(
            _name("workers"), "Workers in the registry by status.", labels=["model", "status"]
        )
        tally: dict[tuple[str, str], int] = {}
        for w in workers:
            key = (w.model, worker_status(w))
            tally[key] = tally.get(key, 0) + 1
        for c in capacity:
            for state in WORKER_STATES:
                count.add_metric([c.model, state], tally.pop((c.model, state), 0))
        for (model, state), n in sorted(tally.items()):  # workers of models not in the catalog
            count.add_metric([model, state], n)
        yield count

        age = GaugeMetricFamily(
            _name("worker_heartbeat_age_seconds"),
            "Seconds since each worker's last heartbeat (lost workers until pruned).",
            labels=["model", "worker", "status"],
        )
        busy = GaugeMetricFamily(
            _name("worker_busy_slots"),
            "Requests a live worker is generating.",
            labels=["model", "worker"],
        )
        slots = GaugeMetricFamily(
            _name("worker_slots"), "Task slots of a live worker.", labels=["model", "worker"]
        )
        speed = GaugeMetricFamily(
            _name("worker_tokens_per_second"),
            "Tokens per second a live worker generated recently.",
            labels=["model", "worker"],
        )
        for w in workers:
            model, wid = w.model, w.id
            age.add_metric([model, wid, worker_status(w)], float(w.heartbeat_age_s))
            if not w.lost:
                busy.add_metric([model, wid], float(w.busy_slots))
                slots.add_metric([model, wid], float(w.total_slots))
                speed.add_metric([model, wid], float(w.tokens_per_s))
        yield from (age, busy, slots, speed)

    def _stored(self) -> Iterator[Metric]:
        self.svc.http_metrics.flush()  # this process's requests since its last write
        counters, histograms = MetricsStore(self.svc.redis, self.svc.settings).read()
        for spec in m.COUNTERS:
            family = CounterMetricFamily(_name(spec.name), spec.help, labels=list(spec.labels))
            for sample in counters[spec.name]:
                family.add_metric([sample.labels[k] for k in spec.labels], sample.value)
            yield family
        for hspec in m.HISTOGRAMS:
            hist = HistogramMetricFamily(_name(hspec.name), hspec.help, labels=list(hspec.labels))
            for h in histograms[hspec.name]:
                hist.add_metric([h.labels[k] for k in hspec.labels], h.buckets, h.sum)
            yield hist


@bp.get("/metrics")
def metrics() -> Response:
    if services().settings.metrics_token_required:
        require_role(*OPERATORS)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FarmCollector(services()))
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def _started() -> None:
    setattr(g, _START, time.perf_counter())


def _finished(response: Response) -> Response:
    started = getattr(g, _START, None)
    if started is None:
        return response
    route = request.url_rule.rule if request.url_rule is not None else "(unmatched)"
    method = request.method
    batch = services().http_metrics.batch()
    batch.inc(
        m.HTTP_REQUESTS, {"route": route, "method": method, "status": str(response.status_code)}
    )
    batch.observe(
        m.HTTP_DURATION, {"route": route, "method": method}, time.perf_counter() - started
    )
    batch.commit()
    return response


def init_app(app: Flask) -> None:
    """Register ``/metrics`` and the per-request counters."""
    app.register_blueprint(bp)
    app.before_request(_started)
    app.after_request(_finished)

"""The Grafana dashboard in docker/ reads only metrics the API exports; compose provisions it."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import yaml

from config.settings import PROJECT_ROOT
from jobs import metrics as m

DOCKER = PROJECT_ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "switchyard.json"
METRIC = re.compile(r"\bswitchyard_[a-z0-9_]+")


def exported_names() -> set[str]:
    """Every series name ``GET /metrics`` can render: stored counters and histograms, and the
    gauges api/metrics.py builds (each named through its ``_name("...")``)."""
    names = {f"{m.NAMESPACE}_{c.name}_total" for c in m.COUNTERS}
    for h in m.HISTOGRAMS:
        names |= {f"{m.NAMESPACE}_{h.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    tree = ast.parse((PROJECT_ROOT / "api" / "metrics.py").read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "_name"
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(f"{m.NAMESPACE}_{node.args[0].value}")
    return names


def expressions(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def test_dashboard_parses_and_reads_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert dashboard["uid"] and dashboard["panels"] and exprs
    used = {name for e in exprs for name in METRIC.findall(e)}
    exported = exported_names()
    assert "switchyard_queue_depth" in exported  # the gauges were found
    unknown = sorted(used - exported)
    assert not unknown, f"the dashboard reads metrics /metrics never exports: {unknown}"
    for title in ("Queue depth", "Replicas", "Tokens per second", "Time to first token"):
        assert any(p["title"].startswith(title) for p in dashboard["panels"]), title
    # Per-model views group by model only: no per-worker label, so no new series per restart.
    assert not any("worker" in re.findall(r"by \(([^)]*)\)", e)[0] for e in exprs if "by (" in e)


def test_compose_monitoring_profile_provisions_prometheus_and_grafana() -> None:
    services = yaml.safe_load((DOCKER / "compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DOCKER / source).exists(), f"compose {name}: {source} is missing"
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == ["api:8000"]
    provisioning = DOCKER / "grafana" / "provisioning"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {uid}
    provider = yaml.safe_load((provisioning / "dashboards" / "switchyard.yml").read_text())
    mounted = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounted["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert Path(DASHBOARD).parent.name == "dashboards"

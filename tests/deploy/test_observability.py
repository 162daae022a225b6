"""deploy/observability validated offline: the dashboard asks only for
metrics the code defines (with labels they have), covers what an operator
needs, and the Prometheus config scrapes the ports the manifests expose."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
# Series from the NATS Helm chart's exporter, not from mmpipe's code.
EXTERNAL = {"nats_jetstream_consumer_num_pending": {"stream_name", "consumer_name"}}
_DEFINITION = re.compile(r'\b(Counter|Histogram|Gauge)\(\s*"(mmpipe_[a-z0-9_]+)",\s*"[^"]*",\s*\[([^\]]*)\]', re.S)


def defined_metrics() -> dict[str, tuple[str, set[str]]]:
    """Every mmpipe_ metric defined in pipeline/ and stages/: name -> (type, labels)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for package in ("pipeline", "stages"):
        for path in (ROOT / package).rglob("*.py"):
            for kind, name, labels in _DEFINITION.findall(path.read_text()):
                found[name] = (kind, set(re.findall(r'"([a-z_]+)"', labels)))
    return found


def series_of(metrics: dict[str, tuple[str, set[str]]]) -> dict[str, set[str]]:
    """The series names Prometheus sees for each definition, with their labels."""
    series: dict[str, set[str]] = {}
    for name, (kind, labels) in metrics.items():
        if kind == "Histogram":
            series[f"{name}_bucket"] = labels | {"le"}
            series[f"{name}_count"] = series[f"{name}_sum"] = labels
        else:
            series[name] = labels
    return series


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    return data


def expressions() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def test_the_code_defines_the_metrics_this_test_reads() -> None:
    metrics = defined_metrics()
    # The scan must see the definitions (a changed call style would hide them all).
    assert {"mmpipe_queue_wait_seconds", "mmpipe_embedding_cache_hits_total", "mmpipe_tensor_held_bytes"} <= set(
        metrics
    )
    assert metrics["mmpipe_messages_total"] == ("Counter", {"role", "outcome"})


def test_every_dashboard_metric_and_label_exists() -> None:
    known = {**series_of(defined_metrics()), **EXTERNAL}
    for expr in expressions():
        names = re.findall(r"\b((?:mmpipe|nats)_[a-z0-9_]+)\b", expr)
        assert names, expr
        for name in names:
            assert name in known, f"{name} is not exported by the code: {expr}"
        # Every `by (...)` and `{label=...}` names a label of the metrics it groups.
        for group in re.findall(r"by \(([^)]*)\)", expr) + re.findall(r"\{([a-z_]+)=", expr):
            for label in filter(None, (s.strip() for s in group.split(","))):
                assert any(label in known[n] for n in names), f"no metric in {expr} has label {label}"


def test_the_dashboard_covers_the_pipeline() -> None:
    used = " ".join(expressions())
    for metric in (
        "nats_jetstream_consumer_num_pending",  # queue depth per role
        "mmpipe_queue_wait_seconds",
        "mmpipe_time_to_first_token_seconds",
        "mmpipe_inter_token_latency_seconds",
        "mmpipe_stage_seconds",
        "mmpipe_hop_transfer_gbps",
        "mmpipe_embedding_cache_hits_total",
        "mmpipe_embedding_cache_misses_total",
        "mmpipe_errors_total",
        "mmpipe_inflight",
    ):
        assert metric in used, metric
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in board["templating"]["list"]}
    for panel in board["panels"]:
        assert panel["datasource"]["uid"].strip("${}") in names
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def _relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus relabelling (keep and replace, regexes anchored) as it
    applies to one target: None when the target is dropped."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if not match:
                return None
        elif action == "replace":
            if match:
                replacement = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
                labels[rule["target_label"]] = match.expand(replacement)
        else:
            raise AssertionError(f"relabel action {action} is not simulated")
    return labels


def test_prometheus_scrapes_every_mmpipe_pod_on_its_metrics_port() -> None:
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert len(jobs) == len(config["scrape_configs"])
    rules = jobs["mmpipe"]["relabel_configs"]
    for deployment in (o for o in render(ROOT / "deploy" / "k8s" / "overlays" / "e-p-d") if o["kind"] == "Deployment"):
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        # The labels Kubernetes service discovery gives a pod's first declared port.
        target = {"__address__": f"10.1.2.3:{container['ports'][0]['containerPort']}", "__metrics_path__": "/metrics"}
        for key, value in template["metadata"].get("annotations", {}).items():
            target["__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
        for key, value in template["metadata"]["labels"].items():
            target["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
        scraped = _relabel(rules, target)
        name = deployment["metadata"]["name"]
        assert scraped is not None, f"{name} is not scraped"
        port = int(scraped["__address__"].rsplit(":", 1)[1])
        # /metrics lives on the health port (workers) or the HTTP port (bridge).
        assert port in {p["containerPort"] for p in container["ports"]}, name
        assert scraped["__metrics_path__"] == "/metrics"
        assert scraped["component"] == template["metadata"]["labels"]["app.kubernetes.io/component"]

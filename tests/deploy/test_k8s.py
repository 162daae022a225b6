"""deploy/k8s validated offline: every overlay renders, every object passes
the Kubernetes API schemas (kubernetes-validate, strict), every container
runs a real `mmpipe` command, and probes, ports, GPU requests, disruption
budgets, grace periods and KEDA triggers agree with the code."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.bridge.app import Bridge, BridgeSettings
from pipeline.cli import parser
from pipeline.config import PipelineConfig
from pipeline.health import LIVE_PATH, READY_PATH
from pipeline.nats_server import NatsServerConfig
from pipeline.serve import WorkerSettings
from pipeline.settings import load_kind
from pipeline.streams import consumer_config, stream_configs
from schemas.routes import MODES, PROCESSOR
from tests.deploy.kustomize import load_documents, render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# The oldest Kubernetes the manifests promise to work on, and the newest the schemas know.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())

# KEDA's ScaledObject is a CRD: no Kubernetes schema has it. This is the part
# of its CRD (keda.sh/v1alpha1) the manifests use, closed to unknown fields,
# with the nats-jetstream trigger's documented metadata keys.
_SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "nats-jetstream"},
                            "metadata": {
                                "type": "object",
                                "required": ["natsServerMonitoringEndpoint", "account", "stream", "consumer"],
                                "additionalProperties": False,
                                # KEDA reads every metadata value as a string.
                                "patternProperties": {".*": {"type": "string"}},
                                "properties": {
                                    k: {"type": "string"}
                                    for k in (
                                        "natsServerMonitoringEndpoint",
                                        "account",
                                        "stream",
                                        "consumer",
                                        "lagThreshold",
                                        "activationLagThreshold",
                                        "useHttps",
                                    )
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def overlays() -> list[str]:
    return sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def expand(value: str, env: dict[str, str]) -> str:
    """What the kubelet does to a container's args: $(VAR) from its env; an
    unknown one stays as it is."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(container: dict[str, Any], config_maps: dict[str, dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in config_maps, f"{var['name']}: no ConfigMap {ref['name']}"
            data = config_maps[ref["name"]]["data"]
            assert ref["key"] in data, f"{var['name']}: ConfigMap {ref['name']} has no {ref['key']}"
            env[var["name"]] = data[ref["key"]]
        else:
            assert source["secretKeyRef"].get("optional") is True, "a Secret the user must create first"
    return env


@dataclass(frozen=True)
class Command:
    command: str
    role: str | None
    # What the process resolves: its flags over the pod's MMPIPE_* variables.
    settings: Any


def mmpipe_args(container: dict[str, Any], config_maps: dict[str, dict[str, Any]]) -> Command:
    """The container's command, parsed and resolved by mmpipe's own CLI."""
    assert container["command"] == ["mmpipe"]
    env = container_env(container, config_maps)
    args = [expand(a, env) for a in container["args"]]
    unresolved = [a for a in args if "$(" in a]
    assert not unresolved, f"unresolved variables: {unresolved}"
    parsed = parser().parse_args(args)
    return Command(parsed.command, getattr(parsed, "role", None), load_kind(parsed.command, parsed, env).settings)


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port in named, f"no container port named {port}"
    return named[port]


@pytest.fixture(scope="module", params=overlays())
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(K8S / "overlays" / request.param)


def test_an_overlay_per_mode() -> None:
    assert overlays() == sorted(MODES)


def test_every_object_passes_the_api_schemas(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    for obj in objects:
        if obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, _SCALED_OBJECT)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} at {exc.path}")
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "mmpipe"


def test_workers_run_the_roles_of_their_mode(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    mode, objects = overlay
    config_maps = of_kind(objects, "ConfigMap")
    roles = []
    for name, deployment in of_kind(objects, "Deployment").items():
        (container,) = pod_spec(deployment)["containers"]
        args = mmpipe_args(container, config_maps)
        assert args.settings.common.pipeline.mode == mode, name
        if args.command == "bridge":
            continue
        assert args.command == "worker"
        roles.append(args.role)
        assert name == "mmpipe-" + args.role.replace("+", "-")
        assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == name[7:]
        gpus = {k: v.get("nvidia.com/gpu") for k, v in container["resources"].items()}
        if args.role == PROCESSOR:
            assert gpus == {"requests": None, "limits": None}, "the processor runs no model"
        else:
            # The model runs here: one GPU requested and limited (extended
            # resources need both), and the worker put on it.
            assert gpus == {"requests": 1, "limits": 1}, name
            assert args.settings.worker.device.startswith("cuda"), name
    assert sorted(roles) == sorted([PROCESSOR, *MODES[mode]])


def test_probes_point_at_the_worker_health_endpoints(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    config_maps = of_kind(objects, "ConfigMap")
    drain_s = WorkerSettings().drain_grace_s
    for name, deployment in of_kind(objects, "Deployment").items():
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        args = mmpipe_args(container, config_maps)
        # SIGTERM drains for drain_s; the kubelet's SIGKILL must come after.
        assert spec["terminationGracePeriodSeconds"] > drain_s, name
        if args.command != "worker":
            continue
        health = args.settings.worker.health
        assert health.port > 0 and health.host == "0.0.0.0", name
        for probe, path in (("startupProbe", READY_PATH), ("readinessProbe", READY_PATH), ("livenessProbe", LIVE_PATH)):
            get = container[probe]["httpGet"]
            assert get["path"] == path, f"{name} {probe}"
            assert port_number(container, get["port"]) == health.port, f"{name} {probe}"
        # Liveness gives up only after the worker itself calls the loop stuck.
        live = container["livenessProbe"]
        assert live["timeoutSeconds"] >= 1 and live["failureThreshold"] >= 2
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(health.port)
        assert annotations["prometheus.io/path"] == "/metrics"


def test_bridge_service_and_probes(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    config_maps = of_kind(objects, "ConfigMap")
    deployment = of_kind(objects, "Deployment")["mmpipe-bridge"]
    (container,) = pod_spec(deployment)["containers"]
    args = mmpipe_args(container, config_maps)
    assert args.command == "bridge" and args.settings.bridge.host == "0.0.0.0"
    # The paths the bridge really serves.
    app = Bridge(None, None, PipelineConfig(), BridgeSettings()).app()  # type: ignore[arg-type]
    routes = {resource.canonical for resource in app.router.resources()}
    ready = container["readinessProbe"]["httpGet"]
    assert ready["path"] in routes
    assert port_number(container, ready["port"]) == args.settings.bridge.port
    service = of_kind(objects, "Service")["mmpipe-bridge"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == args.settings.bridge.port


def test_a_disruption_budget_per_deployment(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    budgets = of_kind(objects, "PodDisruptionBudget")
    for name, deployment in of_kind(objects, "Deployment").items():
        assert name in budgets, f"{name} has no PodDisruptionBudget"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert budgets[name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_keda_scales_each_role_on_its_durable_consumer(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    config_maps = of_kind(objects, "ConfigMap")
    scaled = of_kind(objects, "ScaledObject")
    nats_values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    monitor_port = nats_values["config"]["monitor"]["port"]
    workers = 0
    for name, deployment in of_kind(objects, "Deployment").items():
        (container,) = pod_spec(deployment)["containers"]
        args = mmpipe_args(container, config_maps)
        if args.command != "worker":
            assert name not in scaled, "the bridge scales on HTTP load, not a queue"
            continue
        workers += 1
        spec = scaled[name]["spec"]
        assert spec["scaleTargetRef"]["name"] == name
        assert spec["minReplicaCount"] >= 1, "a role with no worker makes the bridge answer 503"
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        # The names pipeline/streams.py provisions for this namespace and role.
        config = args.settings.common.pipeline
        consumer = consumer_config(config, args.role)
        streams = {s.name for s in stream_configs(config)}
        assert meta["consumer"] == consumer.durable_name
        assert meta["stream"] == config.subjects.stream(args.role) and meta["stream"] in streams
        assert meta["account"] == "$G"
        assert meta["natsServerMonitoringEndpoint"].endswith(f":{monitor_port}")
        assert int(meta["lagThreshold"]) >= 1
    assert sorted(scaled) == sorted(n for n in of_kind(objects, "Deployment") if n != "mmpipe-bridge")
    assert workers == len(scaled)


def test_nats_helm_values() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    config = values["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    jetstream = config["jetstream"]
    assert jetstream["enabled"] and jetstream["fileStore"]["enabled"] and jetstream["fileStore"]["pvc"]["enabled"]
    assert jetstream["memoryStore"]["enabled"] is False
    # KEDA reads the monitoring port through the client Service.
    assert config["monitor"]["enabled"] and values["service"]["ports"]["monitor"]["enabled"]
    assert config["merge"]["max_payload"] >= NatsServerConfig(data_dir=Path()).max_payload
    nats_url = yaml.safe_load((K8S / "base" / "config.yaml").read_text())["data"]["MMPIPE_NATS_URL"]
    assert nats_url == "nats://nats.nats.svc.cluster.local:4222"


def test_every_file_parses_and_every_kustomization_renders() -> None:
    for path in sorted(K8S.rglob("*.yaml")):
        assert load_documents(path), path
    for kustomization in sorted(K8S.rglob("kustomization.yaml")):
        assert render(kustomization.parent), kustomization

"""deploy/k8s validated offline: every overlay (and variants with the
components on and off) renders with kustomize, every object passes the
Kubernetes API schemas (kubernetes-validate, strict), every container runs a
real `mmpipe` command, the role Deployments are one template, and probes,
ports, GPU requests, disruption budgets, grace periods, KEDA triggers, NATS
credentials, the PodMonitor and the model volume agree with the code."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pipeline.auth import ENV as NATS_AUTH_ENV
from pipeline.cli import parser
from pipeline.health import LIVE_PATH, METRICS_PATH, READY_PATH
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
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
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


# The Prometheus Operator's PodMonitor (monitoring.coreos.com/v1): the part the
# manifests use, closed to unknown fields.
_RELABELINGS = {
    "type": "array",
    "items": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
            "targetLabel": {"type": "string"},
            "action": {"type": "string"},
            "regex": {"type": "string"},
            "replacement": {"type": "string"},
            "separator": {"type": "string"},
        },
    },
}
_POD_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port", "path"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string"},
                            "relabelings": _RELABELINGS,
                        },
                    },
                },
            },
        },
    },
}


def overlays() -> list[str]:
    return sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())


def role_dir(role: str) -> str:
    return role.replace("+", "-")


@dataclass(frozen=True)
class Variant:
    """An overlay the tests write: a mode with components and settings the
    checked-in overlays leave off (literals merge into the ConfigMap mmpipe)."""

    mode: str
    components: tuple[str, ...] = ()
    literals: tuple[str, ...] = ()
    images: tuple[dict[str, str], ...] = ()


# Every mode with no component at all (plain Deployments), and every component
# and knob on at once, with values unlike the defaults.
VARIANTS = {
    **{f"{mode}-bare": Variant(mode) for mode in MODES},
    "e-p-d-everything": Variant(
        "e-p-d",
        ("keda", "monitoring", "model-pvc"),
        (
            "MMPIPE_MODEL=/models/qwen2-vl-7b",
            "MMPIPE_NAMESPACE=prod_2",
            "NATS_ACCOUNT=MMPIPE",
            "NATS_MONITORING_ENDPOINT=nats-monitor.nats.svc:8222",
            "MMPIPE_ENGINE=vllm",
        ),
        ({"name": "mmpipe", "newName": "registry.example/mmpipe", "newTag": "1.0"},),
    ),
    "ep-d-hostpath": Variant("ep-d", ("keda", "model-hostpath"), ("MMPIPE_MODEL=/models/qwen2-vl-2b",)),
}


def write_variant(directory: Path, variant: Variant) -> Path:
    directory.mkdir(parents=True)
    # kustomize takes no absolute paths: reach deploy/k8s relatively.
    k8s = os.path.relpath(K8S, directory)
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "mmpipe",
        "resources": [f"{k8s}/base", *(f"{k8s}/roles/{role_dir(r)}" for r in dict.fromkeys(MODES[variant.mode]))],
        "components": [f"{k8s}/components/{c}" for c in variant.components],
        "configMapGenerator": [
            {"name": "mmpipe", "behavior": "merge", "literals": [f"MMPIPE_MODE={variant.mode}", *variant.literals]}
        ],
        "images": list(variant.images),
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


@dataclass(frozen=True)
class Rendered:
    name: str
    directory: Path
    objects: list[dict[str, Any]]

    @property
    def components(self) -> set[str]:
        """The components the overlay turns on (by directory name)."""
        kustomization = yaml.safe_load((self.directory / "kustomization.yaml").read_text())
        return {Path(c).name for c in kustomization.get("components", [])}

    @property
    def config(self) -> dict[str, str]:
        data: dict[str, str] = of_kind(self.objects, "ConfigMap")["mmpipe"]["data"]
        return data

    @property
    def mode(self) -> str:
        return self.config["MMPIPE_MODE"]

    def workers(self) -> dict[str, tuple[dict[str, Any], Command]]:
        """Worker Deployments by name, with their parsed command."""
        config_maps = of_kind(self.objects, "ConfigMap")
        found = {}
        for name, deployment in of_kind(self.objects, "Deployment").items():
            (container,) = pod_spec(deployment)["containers"]
            args = mmpipe_args(container, config_maps)
            if args.command == "worker":
                found[name] = (deployment, args)
        return found


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


def gpus(container: dict[str, Any]) -> int:
    resources = container["resources"]
    requested = resources.get("requests", {}).get("nvidia.com/gpu", 0)
    limited = resources.get("limits", {}).get("nvidia.com/gpu", 0)
    # An extended resource is requested and limited alike.
    assert requested == limited, container["name"]
    return int(limited)


@pytest.fixture(scope="module", params=[*overlays(), *VARIANTS])
def overlay(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    name = request.param
    if name in VARIANTS:
        directory = write_variant(tmp_path_factory.mktemp("overlays") / name, VARIANTS[name])
    else:
        directory = K8S / "overlays" / name
    return Rendered(name, directory, render(directory))


def test_an_overlay_per_mode() -> None:
    for mode in MODES:
        assert (K8S / "overlays" / mode).is_dir(), mode
        assert Rendered(mode, K8S / "overlays" / mode, render(K8S / "overlays" / mode)).mode == mode
    # Other overlays are examples of one of the modes.
    for name in overlays():
        assert Rendered(name, K8S / "overlays" / name, render(K8S / "overlays" / name)).mode in MODES, name


def test_every_object_passes_the_api_schemas(overlay: Rendered) -> None:
    for obj in overlay.objects:
        if obj["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(obj, _SCALED_OBJECT)
            # KEDA hands the behavior to the HPA it makes: the HPA's schema.
            advanced = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
            if "behavior" in advanced:
                hpa = {
                    "apiVersion": "autoscaling/v2",
                    "kind": "HorizontalPodAutoscaler",
                    "metadata": {"name": obj["metadata"]["name"]},
                    "spec": {
                        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                        "maxReplicas": obj["spec"]["maxReplicaCount"],
                        "behavior": advanced["behavior"],
                    },
                }
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(hpa, version, strict=True)
        elif obj["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(obj, _POD_MONITOR)
        else:
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} at {exc.path}")
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "mmpipe"


def test_workers_run_the_roles_of_their_mode(overlay: Rendered) -> None:
    roles = []
    for name, (deployment, args) in overlay.workers().items():
        (container,) = pod_spec(deployment)["containers"]
        assert args.settings.common.pipeline.mode == overlay.mode, name
        roles.append(args.role)
        # The role argument itself, not a variable.
        assert container["args"][:2] == ["worker", args.role], name
        assert name == "mmpipe-" + role_dir(args.role)
        assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == name[7:]
        worker = args.settings.worker
        assert worker.engine == overlay.config["MMPIPE_ENGINE"], name
        count = gpus(container)
        if args.role == PROCESSOR:
            assert count == 0, "the processor runs no model"
        if count:
            # The model runs here, on the pod's GPUs (cuda:0 first).
            assert worker.device.startswith("cuda"), name
        else:
            assert worker.device == "cpu", f"{name}: no GPU, yet device {worker.device}"
        if count > 1:
            # More GPUs than one only for an engine that spreads the model on them.
            parallel = worker.vllm_args.get("tensor_parallel_size", 1) * worker.vllm_args.get(
                "pipeline_parallel_size", 1
            )
            assert worker.engine == "vllm" and parallel == count, name
    # Exactly the roles of the mode, and the processor.
    assert sorted(roles) == sorted([PROCESSOR, *dict.fromkeys(MODES[overlay.mode])])


# What roles/<role> and an overlay's knobs vary; the rest is the template's.
_COMPONENT = "app.kubernetes.io/component"


def normalized(obj: dict[str, Any], processor: bool = False) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["name"] = "NAME"
    labelled = [obj["metadata"], obj["spec"].get("selector", {}).get("matchLabels")]
    if obj["kind"] == "Deployment":
        spec = obj["spec"]
        spec["replicas"] = "REPLICAS"
        labelled += [spec["template"]["metadata"]]
        (container,) = spec["template"]["spec"]["containers"]
        container["args"][1] = "ROLE"
        env = {var["name"]: var for var in container["env"]}
        env["MMPIPE_DEVICE"] = {"name": "MMPIPE_DEVICE", "value": "DEVICE"}
        container["env"] = sorted(env.values(), key=lambda var: var["name"])
        for kind in ("requests", "limits"):
            container["resources"][kind]["nvidia.com/gpu"] = "GPUS"
        if processor:
            # The processor: CPU and memory of its own, no GPU toleration.
            container["resources"] = spec["template"]["spec"]["tolerations"] = "PROCESSOR"
    elif obj["kind"] == "ScaledObject":
        spec = obj["spec"]
        spec["scaleTargetRef"]["name"] = spec["minReplicaCount"] = "NAME"
        (trigger,) = spec["triggers"]
        trigger["metadata"]["stream"] = trigger["metadata"]["consumer"] = "ROLE"
        if processor:
            spec["maxReplicaCount"] = "PROCESSOR"
    for labels in labelled:
        if labels is not None:
            labels.get("labels", labels)[_COMPONENT] = "COMPONENT"
    return obj


def test_role_objects_are_one_template() -> None:
    """Across the mode overlays, every role's Deployment, PodDisruptionBudget
    and ScaledObject is the same object but for its name, role, replicas and
    GPUs (the processor also for its resources)."""
    by_kind: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for mode in MODES:
        objects = render(K8S / "overlays" / mode)
        workers = Rendered(mode, K8S / "overlays" / mode, objects).workers()
        for obj in objects:
            if obj["metadata"]["name"] in workers and obj["kind"] != "Namespace":
                by_kind.setdefault(obj["kind"], []).append((f"{mode}/{obj['metadata']['name']}", obj))
    assert sorted(by_kind) == ["Deployment", "PodDisruptionBudget", "ScaledObject"]
    for objects in by_kind.values():
        models = [(name, obj) for name, obj in objects if not name.endswith("/mmpipe-processor")]
        processors = [(name, obj) for name, obj in objects if name.endswith("/mmpipe-processor")]
        assert len(models) > 1 and processors
        first_name, first = models[0]
        for name, obj in models[1:]:
            assert normalized(obj) == normalized(first), f"{name} is not {first_name} but for the role"
        for name, obj in processors:
            assert normalized(obj, processor=True) == normalized(first, processor=True), name


def test_probes_point_at_the_worker_health_endpoints(overlay: Rendered) -> None:
    config_maps = of_kind(overlay.objects, "ConfigMap")
    drain_s = WorkerSettings().drain_grace_s
    for name, deployment in of_kind(overlay.objects, "Deployment").items():
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
        assert annotations["prometheus.io/path"] == METRICS_PATH


def test_bridge_service_and_probes(overlay: Rendered) -> None:
    config_maps = of_kind(overlay.objects, "ConfigMap")
    deployment = of_kind(overlay.objects, "Deployment")["mmpipe-bridge"]
    (container,) = pod_spec(deployment)["containers"]
    args = mmpipe_args(container, config_maps)
    assert args.command == "bridge" and args.settings.bridge.host == "0.0.0.0"
    # The bridge's own readiness route, which answers 200 with every worker
    # down (tests/e2e/test_openai_bridge.py): the bridge stays in the Service
    # and answers clients 503 itself, instead of the Service having no endpoint.
    ready = container["readinessProbe"]["httpGet"]
    assert ready["path"] == READY_PATH
    assert port_number(container, ready["port"]) == args.settings.bridge.port
    service = of_kind(overlay.objects, "Service")["mmpipe-bridge"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == args.settings.bridge.port


def test_a_disruption_budget_per_deployment(overlay: Rendered) -> None:
    budgets = of_kind(overlay.objects, "PodDisruptionBudget")
    for name, deployment in of_kind(overlay.objects, "Deployment").items():
        assert name in budgets, f"{name} has no PodDisruptionBudget"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert budgets[name]["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # Each budget covers its own role's pods, no other Deployment's.
        for other, pods in of_kind(overlay.objects, "Deployment").items():
            if other != name:
                selector = budgets[name]["spec"]["selector"]["matchLabels"]
                assert not selector.items() <= pods["spec"]["template"]["metadata"]["labels"].items(), other


def test_keda_scales_each_role_on_its_durable_consumer(overlay: Rendered) -> None:
    scaled = of_kind(overlay.objects, "ScaledObject")
    if "keda" not in overlay.components:
        assert not scaled, "KEDA off: plain Deployments"
        return
    nats_values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    monitor_port = nats_values["config"]["monitor"]["port"]
    workers = overlay.workers()
    assert sorted(scaled) == sorted(workers), "a ScaledObject per worker role, none for the bridge"
    for name, (deployment, args) in workers.items():
        spec = scaled[name]["spec"]
        assert spec["scaleTargetRef"]["name"] == name
        assert spec["minReplicaCount"] >= 1, "a role with no worker makes the bridge answer 503"
        # The overlay's replicas are the floor KEDA scales down to.
        assert spec["minReplicaCount"] == deployment["spec"]["replicas"] <= spec["maxReplicaCount"]
        # cooldownPeriod only delays scaling to zero, which minReplicaCount
        # rules out: scale-in waits in the HPA's stabilization window instead.
        assert "cooldownPeriod" not in spec
        scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert scale_down["stabilizationWindowSeconds"] > spec["pollingInterval"]
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        # The names pipeline/streams.py provisions for the namespace this
        # role's processes run with.
        config = args.settings.common.pipeline
        consumer = consumer_config(config, args.role)
        streams = {s.name for s in stream_configs(config)}
        assert meta["consumer"] == consumer.durable_name
        assert meta["stream"] == config.subjects.stream(args.role) and meta["stream"] in streams
        # Account and endpoint from the ConfigMap, the one place they are set.
        assert meta["account"] == overlay.config["NATS_ACCOUNT"]
        assert meta["natsServerMonitoringEndpoint"] == overlay.config["NATS_MONITORING_ENDPOINT"]
        assert meta["natsServerMonitoringEndpoint"].endswith(f":{monitor_port}")
        assert int(meta["lagThreshold"]) >= 1


def test_nats_credentials_come_from_a_secret(overlay: Rendered) -> None:
    wanted = {NATS_AUTH_ENV["user"], NATS_AUTH_ENV["password"], NATS_AUTH_ENV["token"]}
    for name, deployment in of_kind(overlay.objects, "Deployment").items():
        (container,) = pod_spec(deployment)["containers"]
        refs = {
            var["name"]: var["valueFrom"]["secretKeyRef"]
            for var in container["env"]
            if "secretKeyRef" in var.get("valueFrom", {})
        }
        assert wanted <= refs.keys(), f"{name}: no {sorted(wanted - refs.keys())}"
        # One Secret, each key its own; optional (no Secret: no credentials).
        assert len({refs[var]["name"] for var in wanted}) == 1, name
        assert len({refs[var]["key"] for var in wanted}) == len(wanted), name
        assert all(refs[var].get("optional") is True for var in wanted), name


def test_pod_monitor_scrapes_every_pod_on_its_metrics_port(overlay: Rendered) -> None:
    monitors = of_kind(overlay.objects, "PodMonitor")
    if "monitoring" not in overlay.components:
        assert not monitors
        return
    (monitor,) = monitors.values()
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    config_maps = of_kind(overlay.objects, "ConfigMap")
    for name, deployment in of_kind(overlay.objects, "Deployment").items():
        template = deployment["spec"]["template"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), name
        (container,) = template["spec"]["containers"]
        args = mmpipe_args(container, config_maps)
        # Where this process serves /metrics: the health port or the bridge's.
        port = args.settings.worker.health.port if args.command == "worker" else args.settings.bridge.port
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        scraped = [e for e in endpoints if e["port"] in named]
        assert len(scraped) == 1, f"{name}: scraped by {scraped}"
        assert named[scraped[0]["port"]] == port and scraped[0]["path"] == METRICS_PATH, name


def test_pods_run_unprivileged(overlay: Rendered) -> None:
    for name, deployment in of_kind(overlay.objects, "Deployment").items():
        spec = pod_spec(deployment)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in context["capabilities"] and not context.get("privileged"), name


def test_gpu_pods_have_shared_memory(overlay: Rendered) -> None:
    for name, (deployment, _) in overlay.workers().items():
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        if not gpus(container):
            continue
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory", name


def test_the_model_comes_from_the_models_volume(overlay: Rendered) -> None:
    claims = of_kind(overlay.objects, "PersistentVolumeClaim")
    for name, (deployment, args) in overlay.workers().items():
        spec = pod_spec(deployment)
        (container,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        models = volumes[mounts["/models"]["name"]]
        assert mounts["/models"].get("readOnly") is True, name
        if "model-pvc" in overlay.components:
            assert models["persistentVolumeClaim"]["claimName"] in claims, name
        elif "model-hostpath" in overlay.components:
            assert models["hostPath"]["path"].startswith("/"), name
        else:
            assert models == {"name": "models", "emptyDir": {}}, name
        model = args.settings.worker.model
        if model.startswith("/"):
            # A checkpoint path: on the volume mounted at /models.
            assert model.startswith("/models/") and "emptyDir" not in models, name


def test_one_image_that_kustomize_sets(overlay: Rendered) -> None:
    images = {"mmpipe": "mmpipe"} | {i["name"]: i["newName"] for i in VARIANTS.get(overlay.name, Variant("")).images}
    for name, deployment in of_kind(overlay.objects, "Deployment").items():
        for container in pod_spec(deployment)["containers"]:
            # `kustomize edit set image mmpipe=...` renames every container's image.
            assert container["image"].rpartition(":")[0] == images["mmpipe"], name


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
    base = yaml.safe_load((K8S / "base" / "config.yaml").read_text())["data"]
    assert base["MMPIPE_NATS_URL"] == "nats://nats.nats.svc.cluster.local:4222"
    assert base["NATS_MONITORING_ENDPOINT"] == f"nats.nats.svc.cluster.local:{config['monitor']['port']}"


def test_every_file_parses_and_every_kustomization_renders() -> None:
    for path in sorted(K8S.rglob("*.yaml")):
        assert load_documents(path), path
    for kustomization in sorted(K8S.rglob("kustomization.yaml")):
        # Components render only inside a kustomization that includes them.
        if yaml.safe_load(kustomization.read_text())["kind"] != "Component":
            assert render(kustomization.parent), kustomization

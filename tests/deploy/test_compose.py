"""deploy/compose checked without a container daemon: every mmpipe service
runs a command mmpipe's parser takes with MMPIPE_* variables its settings
load, the worker roles are the hops of the mode, tensors move by NIXL over
shared memory, GPU workers reserve a GPU (none in the CPU override), and
Prometheus and Grafana reach ports and files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from pipeline.cli import parser
from pipeline.nats_server import NatsServerConfig
from pipeline.settings import KINDS, leaves, load_kind
from schemas.routes import MODES, PROCESSOR, moves_tensors
from tests.deploy.test_container import stages

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
FILES = {"gpu": ["compose.yaml"], "cpu": ["compose.yaml", "compose.cpu.yaml"]}


class _Reset:
    """Compose's !reset: the key goes."""


class _Override:
    """Compose's !override: the value replaces, unmerged."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: _Reset())
_Loader.add_constructor(
    "!override",
    lambda loader, node: _Override(
        loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)
    ),
)

_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)")


def interpolate(value: Any, seen: set[str]) -> Any:
    """Compose's ${VAR:-default} with nothing set: the defaults, whatever the
    environment of the test. ``seen`` collects the variable names."""
    if isinstance(value, str):

        def one(m: re.Match[str]) -> str:
            if m[0] == "$$":
                return "$"
            seen.add(m[1] or m[3])
            return m[2] or ""

        return _VARIABLE.sub(one, value)
    if isinstance(value, dict):
        return {k: interpolate(v, seen) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, seen) for v in value]
    return value


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of a later file, for the keys these files use:
    mappings merge by key, !reset removes, anything else replaces."""
    if isinstance(override, _Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if isinstance(value, _Reset):
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value) if key in base else merge(None, value)
        return out
    return override


def project(variant: str) -> tuple[dict[str, Any], set[str]]:
    """The project a `docker compose -f ... -f ...` of the variant runs, and its variables."""
    merged: dict[str, Any] = {}
    for name in FILES[variant]:
        merged = merge(merged, yaml.load((COMPOSE / name).read_text(), Loader=_Loader))
    seen: set[str] = set()
    return interpolate(merged, seen), seen


def is_mmpipe(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("mmpipe:")


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def setting(kind: str, settings: object, flag: str) -> Any:
    leaf = next(leaf for leaf in leaves(KINDS[kind]) if leaf.flag == flag)
    value = settings
    for name in leaf.path:
        value = getattr(value, name)
    return value


def run(service: dict[str, Any]) -> tuple[Any, Any]:
    """The service's argv as the image runs it (its ENTRYPOINT, then `command`),
    parsed by mmpipe's parser, and the settings its environment loads."""
    entrypoint = stages()["cpu"].all("ENTRYPOINT")[-1].json_or_shell()
    command = service["command"]
    assert isinstance(command, list), "the exec form: no shell between compose and mmpipe"
    args = parser().parse_args([*entrypoint[1:], *command])
    return args, load_kind(args.command, args, environment(service)).settings


def mmpipe_services(variant: str) -> dict[str, tuple[dict[str, Any], Any, Any]]:
    services = project(variant)[0]["services"]
    return {name: (s, *run(s)) for name, s in services.items() if is_mmpipe(s)}


def listens_on(service: dict[str, Any], settings: Any, args: Any) -> set[int]:
    """The ports a service's process serves on the compose network."""
    if args is not None:
        if args.command == "bridge":
            return {setting("bridge", settings, "port")}
        return {setting(args.command, settings, "health-port")} - {0}
    ports = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
    return ports | {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])}


def number(pattern: str, text: str) -> int:
    """The one number ``pattern`` (a regex with one group, per line) finds in a config file."""
    found = re.search(pattern, text, re.M)
    assert found, pattern
    return int(found[1])


def binds(service: dict[str, Any]) -> dict[str, Path]:
    """Bind mounts by container path: the host path, relative to the compose file."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (COMPOSE / source).resolve()
    return out


@pytest.mark.parametrize("variant", FILES)
def test_every_mmpipe_service_runs_a_command_and_variables_mmpipe_takes(variant: str) -> None:
    compose, variables = project(variant)
    services = mmpipe_services(variant)
    assert {"processor", "encode", "prefill-decode", "bridge"} <= set(services)
    for name, (service, args, _) in services.items():
        # Variables of this process's own kind: one another kind takes would be ignored without a word.
        own = {leaf.env for leaf in leaves(KINDS[args.command])}
        for variable in environment(service):
            if variable.startswith("MMPIPE_"):
                assert variable in own, f"{name}: {variable} is no setting of `mmpipe {args.command}`"
    every = {leaf.env for kind in KINDS.values() for leaf in leaves(kind)}
    assert all(v in every for v in variables if v.startswith("MMPIPE_")), variables
    # Every named volume is declared.
    declared = set(compose.get("volumes", {}))
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = str(volume).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, source
            else:
                assert (COMPOSE / source).exists(), f"bind mount {source}: no such path"


@pytest.mark.parametrize("variant", FILES)
def test_the_worker_roles_are_the_hops_of_the_mode(variant: str) -> None:
    services = mmpipe_services(variant)
    agreed = {
        flag: {setting(args.command, s, flag) for _, args, s in services.values()}
        for flag in ("mode", "namespace", "nats-url")
    }
    assert all(len(values) == 1 for values in agreed.values()), agreed
    (mode,) = agreed["mode"]
    roles = [args.role for _, args, _ in services.values() if args.command == "worker"]
    assert sorted(roles) == sorted([PROCESSOR, *MODES[mode]]), (mode, roles)
    # The NATS URL is the nats service, on the port its config listens on, with JetStream on.
    (url,) = agreed["nats-url"]
    nats = project(variant)[0]["services"][urlsplit(url).hostname]
    assert "-js" in nats["command"] or "--jetstream" in nats["command"]
    config = binds(nats)[nats["command"][nats["command"].index("-c") + 1]].read_text()
    assert urlsplit(url).port == number(r"^port:\s*(\d+)", config)


def test_nats_takes_the_embedded_servers_limits() -> None:
    nats = project("gpu")[0]["services"]["nats"]
    config = binds(nats)["/etc/nats/nats.conf"].read_text()
    embedded = NatsServerConfig(data_dir=Path("/data"))
    numbers = {k: int(v) for k, v in re.findall(r"^\s*(\w+):\s*(\d+)\s*$", config, re.M)}
    assert numbers["max_payload"] == embedded.max_payload
    assert numbers["max_memory_store"] == embedded.jetstream_max_memory
    assert numbers["max_file_store"] == embedded.jetstream_max_file
    # The store is on the named volume, so a restart keeps the streams.
    store = re.findall(r'store_dir:\s*"?([^"\s]+)"?', config)[0]
    volumes = {str(v).split(":")[1]: str(v).split(":")[0] for v in nats["volumes"]}
    assert store in volumes and not volumes[store].startswith((".", "/"))


@pytest.mark.parametrize("variant", FILES)
def test_hop_workers_move_tensors_by_nixl_over_shared_memory(variant: str) -> None:
    hops = 0
    for name, (service, args, settings) in mmpipe_services(variant).items():
        if args.command == "worker" and moves_tensors(args.role):
            hops += 1
            assert setting("worker", settings, "transport") == "nixl", name
            assert service.get("ipc") == "host" or service.get("shm_size"), name
    assert hops >= 2


@pytest.mark.parametrize("variant", FILES)
def test_gpu_workers_reserve_a_gpu(variant: str) -> None:
    gpus = 0
    for name, (service, args, settings) in mmpipe_services(variant).items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        device = setting(args.command, settings, "device") if args.command == "worker" else "cpu"
        if device.startswith("cuda"):
            gpus += 1
            assert service["image"] == "mmpipe:cuda", name
            assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert devices[0].get("count") == 1 or len(devices[0].get("device_ids", [])) == 1, name
        else:
            assert not devices, f"{name} runs on {device} but reserves {devices}"
            if variant == "cpu":
                assert service["image"] == "mmpipe:cpu", name
    assert gpus == (2 if variant == "gpu" else 0)


def test_the_bridge_and_the_workers_are_reachable_where_they_say() -> None:
    services = project("gpu")[0]["services"]
    for name, (service, args, settings) in mmpipe_services("gpu").items():
        ports = listens_on(service, settings, args)
        if args.command == "bridge":
            assert setting("bridge", settings, "host") == "0.0.0.0"
            published = {int(str(p).rsplit(":", 1)[-1]) for p in service["ports"]}
            assert ports <= published
        else:
            assert setting("worker", settings, "health-host") == "0.0.0.0" and ports, name
        # The healthcheck asks the port the process serves.
        test = " ".join(service["healthcheck"]["test"])
        assert {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)/health", test)} == ports, name
    assert services["bridge"]["ports"] == ["8000:8000"]


def test_prometheus_scrapes_every_mmpipe_process_where_it_listens() -> None:
    services = project("gpu")[0]["services"]
    mmpipe = mmpipe_services("gpu")
    prometheus = services["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(binds(prometheus)[config_path].read_text())
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.rsplit(":", 1)
                assert host in services, f"{target}: no service {host}"
                service, args, settings = mmpipe.get(host, (services[host], None, None))
                assert int(port) in listens_on(service, settings, args), f"{target}: {host} does not listen there"
                scraped.add(host)
    assert set(mmpipe) <= scraped
    # The JetStream gauges the dashboard reads come from the exporter, which reads the nats service.
    exporter = services["nats-exporter"]
    monitor = urlsplit(exporter["command"][-1])
    config_text = binds(services["nats"])["/etc/nats/nats.conf"].read_text()
    assert monitor.hostname == "nats"
    assert monitor.port == number(r"^http_port:\s*(\d+)", config_text)
    assert "-jsz=all" in exporter["command"] and "-prefix=nats" in exporter["command"]


def test_grafana_provisions_the_dashboard_on_prometheus() -> None:
    services = project("gpu")[0]["services"]
    grafana = services["grafana"]
    mounts = binds(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasources,) = [yaml.safe_load(p.read_text()) for p in (provisioning / "datasources").glob("*.y*ml")]
    (source,) = datasources["datasources"]
    url = urlsplit(source["url"])
    prometheus = services[url.hostname]
    assert url.port in listens_on(prometheus, None, None)
    dashboard_providers = [yaml.safe_load(p.read_text()) for p in (provisioning / "dashboards").glob("*.y*ml")]
    (provider,) = [p for d in dashboard_providers for p in d["providers"]]
    folder = PurePosixPath(provider["options"]["path"])
    dashboards = [host for target, host in mounts.items() if PurePosixPath(target).parent == folder]
    assert dashboards == [(ROOT / "deploy" / "observability" / "grafana-dashboard.json").resolve()]
    dashboard = json.loads(dashboards[0].read_text())
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    # The dashboard's datasource variable picks the provisioned default of its type.
    assert variable["query"] == source["type"] and source["isDefault"] is True


def test_the_cpu_override_is_compose_syntax_this_test_merges() -> None:
    # !reset is Compose 2.24's; the merge above must see it, or the GPU reservations would stay.
    text = (COMPOSE / "compose.cpu.yaml").read_text()
    overrides = yaml.load(text, Loader=_Loader)["services"]
    assert any(isinstance(s.get("deploy"), _Reset) for s in overrides.values())
    assert set(overrides) <= set(project("gpu")[0]["services"])

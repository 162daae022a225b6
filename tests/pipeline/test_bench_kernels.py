"""`mmpipe bench kernels` runs end to end (the smoke preset on the CPU,
where nothing compiles and no kernel is profiled; its figures mean
something on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.bench import main as bench
from pipeline.cli import parser


def test_bench_kernels_measures_both_engines_and_writes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kernels.json"
    flags = ["--preset", "qwen2-vl-smoke", "--image-size", "56x84", "--repeats", "2", "--output", str(out)]
    assert bench(parser().parse_args(["bench", "kernels", *flags])) == 0
    result = json.loads(out.read_text())
    assert [run["compiled"] for run in result["runs"]] == [False, True]
    for run in result["runs"]:
        assert set(run["calls"]) == {"encode", "prefill", "cached", "cached (modules)"}
        # The later turn found all of the conversation's full blocks before its question.
        assert run["turn_tokens"] - 32 < run["cached_tokens"] < run["turn_tokens"] and run["cached_tokens"] % 16 == 0
        assert all(call["ms"] > 0 and call["kernels"] is None for call in run["calls"].values())
        # A 56×84 image: 4×6 patches of 14 pixels, merged 2×2 into 6 tokens, in place of its placeholder.
        assert run["image_tokens"] == 6 and run["prompt_tokens"] > 6
    assert result["runs"][0]["prompt_tokens"] == result["runs"][1]["prompt_tokens"]
    table = capsys.readouterr().out
    assert "uncompiled ms" in table and table.count("encode") >= 1 and "prefill" in table

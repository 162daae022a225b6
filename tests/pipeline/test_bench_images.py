"""``mmpipe bench images``: the image-generation stage against the diffusers
pipeline alone, run on this CPU with the tiny pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_bench_images_measures_the_stage_against_the_pipeline_alone(mmpipe_home: Path) -> None:
    """`mmpipe bench images` on this CPU (the tiny pipeline, a few steps): a
    row per batch, both figures measured, the ratio theirs, and the stage's
    drawing and its PNGs (from the worker's hop trace) inside its request's time."""
    cmd = [sys.executable, "-m", "pipeline.cli", "bench", "images", "--preset", "tiny-sd", "--batches", "1,2"]
    cmd += ["--steps", "2", "--size", "64x64", "--repeats", "1", "--device", "cpu", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["diffusers_images_per_s"] > 0 and row["mmpipe_images_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["mmpipe_images_per_s"] / row["diffusers_images_per_s"])
        assert row["request_s"] == pytest.approx(row["batch"] / row["mmpipe_images_per_s"])
        # The drawing and then its PNGs, each timed in the worker, inside the request.
        assert row["stage_drawing_s"] > 0 and row["stage_png_s"] > 0
        assert row["stage_drawing_s"] + row["stage_png_s"] < row["request_s"]
        # The baseline is the fastest way of calling the pipeline alone, before the stack ran or after.
        calls = (row["diffusers_main_thread_s"], row["diffusers_own_thread_s"])
        calls += (row["diffusers_after_main_thread_s"], row["diffusers_after_own_thread_s"])
        assert min(calls) > 0 and row["diffusers_call_s"] == min(calls)
        assert row["diffusers_images_per_s"] == pytest.approx(row["batch"] / min(calls))

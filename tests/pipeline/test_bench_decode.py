"""`mmpipe bench decode` runs end to end (tiny shapes on the CPU; its
figures mean something only on a GPU, where README's table comes from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.bench import main as bench
from pipeline.cli import parser


def test_bench_decode_prints_and_writes_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.json"
    flags = ["--presets", "qwen2-vl-smoke", "--batches", "1,3", "--context", "12", "--new-tokens", "6", "--chunk", "16"]
    args = parser().parse_args(["bench", "decode", *flags, "--repeats", "1", "--output", str(out)])
    assert bench(args) == 0
    results = json.loads(out.read_text())
    assert [(r["preset"], r["batch"]) for r in results["runs"]] == [("qwen2-vl-smoke", 1), ("qwen2-vl-smoke", 3)]
    for row in results["runs"]:
        assert row["decoder_step_ms"] > 0 and row["generate_step_ms"] > 0 and row["decoder_sync_step_ms"] > 0
        assert row["ahead_tokens_equal"] is True
        assert row["decoder_tok_s"] == pytest.approx(row["batch"] * 1e3 / row["decoder_step_ms"])
        # The same steps with penalties, a bias and logprobs on every row, against the plain ones.
        assert row["decoder_extras_step_ms"] > 0
        assert row["extras_overhead"] == pytest.approx(
            row["decoder_extras_step_ms"] / row["decoder_paired_step_ms"] - 1
        )
        # And on the modules' step and the fused one, every row one of 4 random LoRA adapters, against none.
        assert row["decoder_modules_step_ms"] > 0 and row["decoder_lora_step_ms"] > 0
        assert row["lora_overhead"] == pytest.approx(row["decoder_lora_step_ms"] / row["decoder_modules_step_ms"] - 1)
        assert row["decoder_fused_step_ms"] > 0 and row["decoder_fused_lora_step_ms"] > 0
        assert row["lora_fused_overhead"] == pytest.approx(
            row["decoder_fused_lora_step_ms"] / row["decoder_fused_step_ms"] - 1
        )
        assert row["lora_fused_agree"] == 1.0  # float32 on the CPU: the two forms' tokens alike
        # And the fused step with room for those adapters (--max-loras), none loaded.
        assert row["decoder_fused_reserved_step_ms"] > 0
        assert row["lora_reserved_overhead"] == pytest.approx(
            row["decoder_fused_reserved_step_ms"] / row["decoder_fused_step_ms"] - 1
        )
        # And with every row sampling in the step.
        assert row["decoder_sampled_step_ms"] > 0
        assert row["sampling_overhead"] == pytest.approx(
            row["decoder_sampled_step_ms"] / row["decoder_paired_step_ms"] - 1
        )
        # And a step carrying a 16-token chunk of a long prompt, against the step and the chunk alone.
        assert row["chunk_tokens"] == 16 and row["mixed_step_ms"] > 0 and row["chunk_alone_ms"] > 0
        assert row["mixed_vs_step_and_chunk"] == pytest.approx(
            row["mixed_step_ms"] / (row["decoder_plain_step_ms"] + row["chunk_alone_ms"])
        )
        assert row["mixed_step_agree"] == 1.0
    # The first batch checks the decoder's greedy tokens against generate() on the same prefill.
    assert 0 < results["runs"][0]["greedy_agree"] <= 1
    table = capsys.readouterr().out
    assert "decoder ms/step" in table and table.count("qwen2-vl-smoke") >= 2

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from stages.detokenizer import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize(
    "text", ["héllo wörld", "你好，世界！这是一个测试。", "emoji 🚀🎉👩‍👩‍👧 ok", "mixed 日本語 and ünïcödé ✓"]
)
def test_deltas_join_to_the_text_and_never_split_a_character(tokenizer: Any, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_the_cases_do_split_characters_across_tokens(tokenizer: Any) -> None:
    ids = tokenizer("emoji 🚀🎉👩‍👩‍👧 ok", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_special_tokens_are_not_text(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer("hi", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "hi"


def test_priming_with_emitted_tokens_continues_the_text(tokenizer: Any) -> None:
    text = "crash 🚀 in the middle"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        first = IncrementalDetokenizer(tokenizer)
        sent = "".join(first.push(i) for i in ids[:cut])
        resumed = IncrementalDetokenizer(tokenizer)
        for i in ids[:cut]:
            resumed.push(i)
        rest = "".join(resumed.push(i) for i in ids[cut:]) + resumed.flush()
        assert sent + rest == text, cut


def test_stop_strings_hold_back_and_cut() -> None:
    m = StopStringMatcher(["STOP"])
    out = [m.feed(d) for d in ["ab", "cS", "T", "OPxyz"]]
    assert "".join(t for t, _ in out) == "abc"
    assert out[-1][1] is True
    m2 = StopStringMatcher(["STOP"])
    emitted = "".join(m2.feed(d)[0] for d in ["ab", "ST", "x"]) + m2.flush()
    assert emitted == "abSTx"
    assert StopStringMatcher([]).feed("abc") == ("abc", False)

"""``SegmentTokenizer``: a prompt's ids a piece between special tokens at a
time, the long pieces remembered, always the tokenizer's own ids for the
whole text, special tokens, odd spacing and unicode at their edges included."""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from stages.chat_tokens import MIN_ENTRY_CHARS, SegmentTokenizer
from stages.models import builtin_path

FRAGMENTS = [
    "the",
    " the",
    "Hello",
    " world",
    "  ",
    "\n",
    "\n\n",
    "\t",
    " ",
    "é",
    "e\u0301",  # e and a combining acute: NFC makes it é
    "ﬁ",
    "日本語",
    "🙂",
    "123",
    "4.5",
    "'s",
    "don't",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<image>",
    "<|im_",  # a special token's halves, apart
    "start|>",
    "<|",
    "|>",
    "user",
    "assistant",
    "system",
    " the quick brown fox jumps over the lazy dog" * 3,  # a piece long enough to be kept
]


def _tokenizer(name: str) -> Any:
    return AutoTokenizer.from_pretrained(builtin_path(name))


def _whole(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40))) for _ in range(count)]


# The new pieces encoded in one batch (the pool's threads), one by one on the caller's thread, or as their size says.
@pytest.mark.parametrize("serial_chars", [0, 1 << 30, None], ids=["batched", "one-by-one", "by-size"])
@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava", "tiny-qwen2-audio"])
def test_the_ids_are_the_tokenizers_own_for_any_text_and_again_from_what_it_kept(
    model: str, serial_chars: int | None
) -> None:
    tokenizer = _tokenizer(model)
    pieces = (
        SegmentTokenizer(tokenizer) if serial_chars is None else SegmentTokenizer(tokenizer, serial_chars=serial_chars)
    )
    texts = _texts(seed=len(model), count=400)
    for text in texts + texts:  # the second time through, the long pieces come from what it kept
        assert pieces(text) == _whole(tokenizer, text), text
    assert pieces.hit_chars > 0 and pieces.kept_chars > 0


def test_a_conversations_later_turn_encodes_only_its_new_pieces() -> None:
    tokenizer = _tokenizer("tiny-qwen2-vl")
    pieces = SegmentTokenizer(tokenizer)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant." + " the" * 600},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?" + " the" * 50}]},
    ]
    for turn in range(4):
        text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        before = pieces.miss_chars
        assert pieces(text) == _whole(tokenizer, text)
        encoded = pieces.miss_chars - before
        if turn == 0:
            assert encoded >= len(" the" * 600)
        else:
            # Only the answer and the question added since the last turn are new.
            assert 0 < encoded < 600, encoded
        history += [
            {"role": "assistant", "content": f"Answer {turn}: " + "a cat on a mat, " * 8},
            {"role": "user", "content": f"And then, turn {turn + 1}? " + "tell me more " * 6},
        ]


def test_what_it_keeps_stays_within_its_bound_the_oldest_going_first() -> None:
    tokenizer = _tokenizer("tiny-qwen2-vl")
    pieces = SegmentTokenizer(tokenizer, max_chars=4 * 100)
    texts = [f"<|im_start|>{i:03d}" + "x" * 97 + "<|im_end|>" for i in range(10)]
    for text in texts:
        assert pieces(text) == _whole(tokenizer, text)
        assert pieces.kept_chars <= 4 * 100
    hits = pieces.hit_chars
    pieces(texts[-1])  # among the last four kept
    assert pieces.hit_chars == hits + 100
    pieces(texts[0])  # long gone
    assert pieces.hit_chars == hits + 100


def test_short_pieces_are_kept_too_each_holding_at_least_its_minimum_of_the_bound() -> None:
    tokenizer = _tokenizer("tiny-qwen2-vl")
    pieces = SegmentTokenizer(tokenizer, max_chars=4 * MIN_ENTRY_CHARS)
    # A chat template's own short pieces ("\n", "assistant\n") come in every request.
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert pieces(chat) == _whole(tokenizer, chat)
    before = pieces.miss_chars
    assert pieces(chat) == _whole(tokenizer, chat)
    assert pieces.miss_chars == before  # nothing encoded again
    texts = [f"<|im_start|>p{i}<|im_end|>" for i in range(10)]
    for text in texts:
        assert pieces(text) == _whole(tokenizer, text)
        assert pieces.kept_chars <= 4 * MIN_ENTRY_CHARS  # ten 2-character pieces would fit four times over
    hits = pieces.hit_chars
    pieces(texts[-1])
    assert pieces.hit_chars == hits + 2
    pieces(texts[0])  # pushed out by the later ones
    assert pieces.hit_chars == hits + 2

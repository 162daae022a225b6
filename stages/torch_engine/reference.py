"""The project's reference: plain transformers ``generate()`` on a checkpoint.

Tests and benchmarks compare the engine with this. It shares none of the
engine's code paths: it loads the model with the Auto class and the (PIL)
image processor or audio feature extractor itself, expands each media
placeholder to as many copies as the model's encoder gives features
(Qwen-VL: ``grid_thw.prod() // merge_size**2``; LLaVA: one per patch;
LLaVA-NeXT-Video: pooled patches per frame; Qwen2-Audio: the pooled length
of its mel features), builds ``mm_token_type_ids`` where the model takes
them and lets ``generate()`` compute everything else (encoders, merge,
positions, cache).

Video frames are prepared the way the engine's families prepare them (the
PIL image processor, frame by frame; Hugging Face's video processors need
torchvision), so what is compared is the model side: towers, merge,
positions and decoding.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from schemas.request import StructuredOutput
from stages.media import DecodedAudio, DecodedVideo

ReferenceMedia = Image.Image | DecodedVideo | DecodedAudio


def load_reference_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2AudioForConditionalGeneration

    # Qwen2-Audio is not an image-text-to-text model to the Auto classes.
    audio = AutoConfig.from_pretrained(str(model_dir)).model_type == "qwen2_audio"
    cls: Any = Qwen2AudioForConditionalGeneration if audio else AutoModelForImageTextToText
    model: Any = cls.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


def _qwen_image_processor(model_dir: Path) -> Any:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    except ImportError:  # older transformers: the numpy/PIL processor has the plain name
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[assignment]
            Qwen2VLImageProcessor as cls,
        )
    return cls.from_pretrained(str(model_dir))


def _clip_image_processor(model_dir: Path, config_file: str = "preprocessor_config.json") -> Any:
    try:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as cls
    except ImportError:
        from transformers import CLIPImageProcessor as cls  # type: ignore[assignment]
    if config_file == "preprocessor_config.json":
        return cls.from_pretrained(str(model_dir))
    settings = json.loads((model_dir / config_file).read_text())
    settings.pop("video_processor_type", None)
    return cls(**settings)


def _qwen_video(processor: Any, video: DecodedVideo, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """A video's patches: each frame's image patches hold that frame in all
    temporal slots; a video patch holds ``temporal`` consecutive frames."""
    frames = list(video.frames)
    frames += [frames[-1]] * (-len(frames) % temporal)
    per_frame = []
    grid: list[int] = []
    for frame in frames:
        out = processor(images=[frame], return_tensors="pt")
        _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
        grid = [len(frames) // temporal, gh, gw]
        patch = int(processor.patch_size)
        rows = out["pixel_values"].reshape(gh * gw, -1, temporal, patch, patch)
        per_frame.append(rows[:, :, :1])
    steps = [torch.cat(per_frame[i : i + temporal], dim=2) for i in range(0, len(frames), temporal)]
    return torch.cat([s.reshape(s.shape[0], -1) for s in steps]), grid


def _media_inputs(model: Any, model_dir: Path, media: list[ReferenceMedia]) -> tuple[dict[str, Any], list[int]]:
    """generate()'s media keyword arguments, and each item's token count (in order)."""
    config = model.config
    images = [m for m in media if isinstance(m, Image.Image)]
    videos = [m for m in media if isinstance(m, DecodedVideo)]
    audios = [m for m in media if isinstance(m, DecodedAudio)]
    kwargs: dict[str, Any] = {}
    counts: dict[int, int] = {}
    if config.model_type == "llava":
        pixels = _clip_image_processor(model_dir)(images=images, return_tensors="pt")["pixel_values"]
        patch = int(config.vision_config.patch_size)
        per_image = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
        per_image += 1 if config.vision_feature_select_strategy == "full" else 0
        kwargs["pixel_values"] = pixels
        counts.update({id(im): per_image for im in images})
    elif config.model_type == "llava_next_video":
        processor = _clip_image_processor(model_dir, "video_preprocessor_config.json")
        clips = [processor(images=v.frames, return_tensors="pt")["pixel_values"] for v in videos]
        kwargs["pixel_values_videos"] = torch.stack(clips)
        side = clips[0].shape[-1] // int(config.vision_config.patch_size) // int(config.spatial_pool_stride)
        counts.update({id(v): len(v.frames) * side * side for v in videos})
    elif config.model_type == "qwen2_audio":
        from transformers import WhisperFeatureExtractor

        extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        features = extractor(
            [a.samples for a in audios],
            sampling_rate=16_000,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        kwargs["input_features"] = features["input_features"]
        kwargs["feature_attention_mask"] = features["attention_mask"]
        lengths = features["attention_mask"].sum(-1).tolist()
        counts.update({id(a): (((n - 1) // 2 + 1) - 2) // 2 + 1 for a, n in zip(audios, lengths, strict=True)})
    else:  # Qwen2-VL, Qwen2.5-VL
        processor = _qwen_image_processor(model_dir)
        merge = int(config.vision_config.spatial_merge_size)
        if images:
            processed = processor(images=images, return_tensors="pt")
            kwargs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
            counts.update(
                {id(im): int(g.prod()) // merge**2 for im, g in zip(images, processed["image_grid_thw"], strict=True)}
            )
        if videos:
            temporal = int(config.vision_config.temporal_patch_size)
            clips = [_qwen_video(processor, v, temporal) for v in videos]
            grids = torch.tensor([g for _, g in clips])
            kwargs.update(pixel_values_videos=torch.cat([c for c, _ in clips]), video_grid_thw=grids)
            counts.update({id(v): int(g.prod()) // merge**2 for v, g in zip(videos, grids, strict=True)})
            if config.model_type == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = torch.tensor([temporal / v.fps for v in videos])
    return kwargs, [counts[id(m)] for m in media]


def _placeholders(config: Any) -> dict[type, int]:
    if config.model_type == "qwen2_audio":
        return {DecodedAudio: int(config.audio_token_index)}
    if config.model_type == "llava_next_video":
        return {DecodedVideo: int(config.video_token_index)}
    image = int(getattr(config, "image_token_id", None) or config.image_token_index)
    video = getattr(config, "video_token_id", None)
    return {Image.Image: image, **({DecodedVideo: int(video)} if video is not None else {})}


def reference_generate(
    model_dir: Path,
    prompt_token_ids: list[int],
    media: list[ReferenceMedia],
    max_new_tokens: int,
    min_new_tokens: int | None = None,
    model: Any = None,
    streamer: Any = None,
) -> list[int]:
    """Greedy new tokens of ``generate()``.

    prompt_token_ids holds one placeholder per media item, in the order of
    ``media`` (PIL images, sampled videos, decoded audio). min_new_tokens
    defaults to max_new_tokens (random weights may emit EOS early). Pass an
    already loaded `model` (from load_reference_model) to skip loading;
    ``streamer`` is generate()'s (put() gets the prompt, then each new token).
    """
    model = model if model is not None else load_reference_model(model_dir)
    config = model.config
    placeholders = _placeholders(config)
    kinds = {token: kind for kind, token in placeholders.items()}
    kwargs: dict[str, Any] = {}
    ids = list(prompt_token_ids)
    if media:
        media_kwargs, counts = _media_inputs(model, model_dir, media)
        slots = [t for t in ids if t in kinds]
        expect = [placeholders[Image.Image if isinstance(m, Image.Image) else type(m)] for m in media]
        if slots != expect:
            raise ValueError(f"placeholders {slots} do not match the media given ({expect})")
        expanded: list[int] = []
        for tok in ids:
            expanded.extend([tok] * counts.pop(0) if tok in kinds else [tok])
        ids = expanded
        kwargs.update({k: v.to(model.device) for k, v in media_kwargs.items()})
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    # Without mm_token_type_ids generate() silently falls back to 1-D positions
    # for Qwen-VL (transformers 5.x); releases whose forward lacks it compute
    # M-RoPE from input_ids alone, and the other families have no use for it.
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        types[input_ids == placeholders[Image.Image]] = 1
        if DecodedVideo in placeholders:
            types[input_ids == placeholders[DecodedVideo]] = 2
        kwargs["mm_token_type_ids"] = types
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if min_new_tokens is None else min_new_tokens,
            streamer=streamer,
            **kwargs,
        )
    return [int(t) for t in out[0, input_ids.shape[1] :].tolist()]


def reference_logprobs(
    model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int, top: int, model: Any = None
) -> tuple[list[int], list[float], list[list[int]]]:
    """``generate()``'s greedy new tokens for a text prompt (``min_new_tokens``
    too), each one's log probability under the model's raw logits (no logits
    processor: vLLM's raw logprobs), and the ``top`` best token ids of each step."""
    model = model if model is not None else load_reference_model(model_dir)
    out = _generate_text(model, prompt_token_ids, max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = [int(t) for t in out.sequences[0, len(prompt_token_ids) :].tolist()]
    steps = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    chosen = [float(lp[t]) for lp, t in zip(steps, tokens, strict=True)]
    return tokens, chosen, [torch.topk(lp, top).indices.tolist() for lp in steps]


def reference_penalized(
    model_dir: Path,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    presence: float = 0.0,
    frequency: float = 0.0,
    bias: dict[int, float] | None = None,
    model: Any = None,
    repetition: float = 1.0,
) -> list[int]:
    """``generate()``'s greedy new tokens for a text prompt (``min_new_tokens``
    too) with OpenAI's presence and frequency penalties on the tokens
    generated so far (a logits processor of that formula), ``bias`` as
    generate()'s own ``sequence_bias`` and ``repetition`` as its
    ``repetition_penalty``."""
    from transformers import LogitsProcessor, LogitsProcessorList

    prompt_len = len(prompt_token_ids)

    class OpenAIPenalties(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            made = input_ids[0, prompt_len:]
            if made.numel() == 0:
                return scores
            counts = torch.bincount(made, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores.dtype)
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    model = model if model is not None else load_reference_model(model_dir)
    out = _generate_text(
        model,
        prompt_token_ids,
        max_new_tokens,
        logits_processor=LogitsProcessorList([OpenAIPenalties()]),
        sequence_bias={(t,): b for t, b in (bias or {}).items()} or None,
        repetition_penalty=repetition,
    )
    return [int(t) for t in out[0, prompt_len:].tolist()]


def reference_stopped(
    model_dir: Path,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    min_new_tokens: int = 0,
    model: Any = None,
) -> list[int]:
    """``generate()``'s greedy new tokens for a text prompt, ended by the
    model's EOS or any of ``stop_ids`` (all of them masked below
    ``min_new_tokens``), the stopping token last."""
    model = model if model is not None else load_reference_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    out = _generate_text(
        model, prompt_token_ids, max_new_tokens, eos_token_id=[*eos, *stop_ids], min_new_tokens=min_new_tokens
    )
    return [int(t) for t in out[0, len(prompt_token_ids) :].tolist()]


def _generate_text(model: Any, prompt_token_ids: list[int], max_new_tokens: int, **kwargs: Any) -> Any:
    """Greedy ``generate()`` of exactly ``max_new_tokens`` after a text prompt."""
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        return model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **{"min_new_tokens": max_new_tokens, **kwargs},
        )


def reference_generate_embeds(
    model_dir: Path, embeds: torch.Tensor, max_new_tokens: int, model: Any = None
) -> list[int]:
    """Greedy ``generate(inputs_embeds=...)``: exactly ``max_new_tokens``
    after a prompt given as its input embeddings [tokens, hidden] (taken in
    the model's dtype)."""
    model = model if model is not None else load_reference_model(model_dir)
    inputs = embeds[None].to(model.device, model.dtype)
    with torch.inference_mode():
        out = model.generate(
            inputs_embeds=inputs,
            attention_mask=torch.ones(inputs.shape[:2], dtype=torch.long, device=model.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
        )
    # With embeddings alone, generate() returns only the new tokens.
    return [int(t) for t in out[0]]


def reference_structured(
    model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int, spec: StructuredOutput, model: Any = None
) -> list[int]:
    """``generate()``'s greedy new tokens for a text prompt under ``spec``'s
    grammar, masked by xgrammar's own logits processor for transformers,
    ended by the model's EOS once the grammar allows it."""
    import xgrammar as xgr
    import xgrammar.contrib.hf
    from transformers import AutoTokenizer, LogitsProcessorList

    from stages import structured

    model = model if model is not None else load_reference_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    vocab = model.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(str(model_dir)), vocab_size=vocab, stop_token_ids=eos
    )
    compiled = xgr.GrammarCompiler(info).compile_grammar(structured.grammar(spec))
    out = _generate_text(
        model,
        prompt_token_ids,
        max_new_tokens,
        logits_processor=LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(compiled)]),
        min_new_tokens=0,
    )
    return [int(t) for t in out[0, len(prompt_token_ids) :].tolist()]


def reference_prompt_logprobs(
    model_dir: Path, prompt_token_ids: list[int], top: int, model: Any = None
) -> tuple[list[float], list[list[int]]]:
    """Each prompt token's log probability after the first under one forward
    of the whole prompt (the logits at the place before it), and the ``top``
    best token ids at each of those places."""
    model = model if model is not None else load_reference_model(model_dir)
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, input_ids[0, 1:, None])[:, 0].tolist()
    return chosen, torch.topk(logprobs, top).indices.tolist()

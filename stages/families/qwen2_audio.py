"""Qwen2-Audio: a Whisper-style audio encoder (128 mel bins, 30 s window)
and a linear projector in front of a Qwen decoder with plain 1-D positions.

transformers has no ``get_audio_features`` for this model: the encoder call
is inside its forward. ``_encode_audios`` makes that call the way the
forward does (feature lengths, the padding mask, the tower, the projector),
so the embeddings are the ones generate() scatters over ``<|AUDIO|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

from schemas.processed import MediaKind
from stages.families.base import LanguageModelFamily, Media, MediaEmbedding, encode_by_kind
from stages.media import DecodedAudio


class Qwen2AudioFamily(LanguageModelFamily):
    name: ClassVar[str] = "qwen2_audio"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2AudioForConditionalGeneration",)

    def __init__(self, model_dir: Path, config: PretrainedConfig) -> None:
        super().__init__(model_dir, config)
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))

    @classmethod
    def placeholders_of(cls, config: PretrainedConfig) -> dict[MediaKind, int]:
        return {MediaKind.AUDIO: int(config.audio_token_index)}

    @property
    def model_class(self) -> Any:
        return Qwen2AudioForConditionalGeneration

    def num_tokens(self, item: MediaEmbedding) -> int:
        return item.grid_thw[0]

    @torch.inference_mode()
    def encode(self, model: Any, media: list[Media]) -> list[MediaEmbedding]:
        return encode_by_kind(media, {MediaKind.AUDIO: lambda audios: self._encode_audios(model, audios)}, self.name)

    def _encode_audios(self, model: Any, audios: list[DecodedAudio]) -> list[MediaEmbedding]:
        from transformers.masking_utils import create_bidirectional_mask

        inputs = self.feature_extractor(
            [a.samples for a in audios],
            sampling_rate=self.feature_extractor.sampling_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        inner = model.model
        tower = inner.audio_tower
        features = inputs["input_features"].to(tower.device, model.dtype)
        feature_mask = inputs["attention_mask"].to(tower.device)
        # As Qwen2AudioModel.forward: lengths after the conv stem (the mask)
        # and after the pooler (the tokens each audio becomes).
        stem_lengths, token_lengths = tower._get_feat_extract_output_lengths(feature_mask.sum(-1))
        batch, _, mel_frames = features.shape
        stem_frames = (mel_frames - 2) // 2 + 1
        steps = torch.arange(stem_frames, dtype=stem_lengths.dtype, device=stem_lengths.device)
        valid = (steps.unsqueeze(0).expand(batch, stem_frames) < stem_lengths.unsqueeze(1)).to(torch.long)
        dummy = torch.zeros((batch, stem_frames, 1), dtype=model.dtype, device=tower.device)
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=valid)
        hidden = tower(features, attention_mask=mask).last_hidden_state
        projected = inner.multi_modal_projector(hidden)
        return [
            MediaEmbedding(projected[i, : int(n)], (int(n),), MediaKind.AUDIO)
            for i, n in enumerate(token_lengths.tolist())
        ]

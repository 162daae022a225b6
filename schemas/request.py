"""The generate request: what the bridge (or a NATS-native caller) publishes
on ``mmpipe.<ns>.requests``."""

from __future__ import annotations

from typing import Literal

import msgspec


class TextPart(msgspec.Struct, tag="text", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    text: str


class ImageURL(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    url: str
    detail: str | None = None


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    image_url: ImageURL


class VideoURL(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    url: str
    # Frame sampling: num_frames spread evenly, or fps (capped at max_frames);
    # unset: the server's defaults.
    num_frames: int | None = None
    fps: float | None = None
    max_frames: int | None = None


class VideoPart(msgspec.Struct, tag="video_url", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    video_url: VideoURL


class AudioURL(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    url: str


class AudioPart(msgspec.Struct, tag="audio_url", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    audio_url: AudioURL


class InputAudio(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """OpenAI's inline audio: base64 bytes and their format ("wav", "mp3", ...)."""

    data: str
    format: str


class InputAudioPart(
    msgspec.Struct, tag="input_audio", tag_field="type", omit_defaults=True, forbid_unknown_fields=True
):
    input_audio: InputAudio


class ImageEmbeds(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A .safetensors payload (data: URL or allow-listed file) of embeddings
    made with the model's own encoder: 'embeddings' [tokens, hidden] and, for
    Qwen-VL, 'grid' [3]."""

    url: str


class ImageEmbedsPart(
    msgspec.Struct, tag="image_embeds", tag_field="type", omit_defaults=True, forbid_unknown_fields=True
):
    image_embeds: ImageEmbeds


ContentPart = TextPart | ImagePart | ImageEmbedsPart | VideoPart | AudioPart | InputAudioPart
MediaPart = ImagePart | ImageEmbedsPart | VideoPart | AudioPart | InputAudioPart


class ChatMessage(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] = ""
    # The participant's name: handed to the chat template, as vLLM does (most templates ignore it).
    name: str | None = None


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the answer must match, one kind (vLLM's ``StructuredOutputsParams``):
    ``json`` (``text``: a JSON schema), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (``text``: a JSON list of the strings), ``grammar`` (EBNF)."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    text: str = ""
    # JSON without whitespace between tokens (vLLM's disable_any_whitespace).
    compact: bool = False


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    # None means "the server's default": the processor fills it in.
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # The processor fixes a seed for every request so a takeover after a
    # crash samples the same tokens.
    seed: int | None = None
    stop: list[str] = []
    min_tokens: int = 0
    ignore_eos: bool = False
    # Each generated token's logprob and this many most likely tokens' (0..20); None: none.
    logprobs: int | None = None
    # OpenAI's: subtracted from a token's logit once it was generated (presence)
    # and once each time (frequency); added to the token's logit (logit_bias).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    # vLLM's: a prompt or generated token's logit divided by it (multiplied
    # where negative), as transformers' RepetitionPenaltyLogitsProcessor.
    repetition_penalty: float = 1.0
    # Tokens less likely than min_p times the most likely one are not sampled.
    min_p: float = 0.0
    # Token ids that end the sequence as EOS does (masked below min_tokens; not in the text).
    stop_token_ids: list[int] = []
    structured: StructuredOutput | None = None
    # The prompt's logprobs too (each token after the first, and this many
    # most likely tokens at each place): a completion's ``echo`` with ``logprobs``.
    prompt_logprobs: int | None = None


class ImageParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What an image-generation stage draws (OpenAI's images API, and the
    stage of a multi-stage route): ``prompt`` (empty: the text the stage
    before it wrote), ``n`` images from one seeded generator, their size
    (0: the model's own), denoising steps (0: the server's default) and
    classifier-free guidance (0: the server's default)."""

    prompt: str = ""
    n: int = 1
    width: int = 0
    height: int = 0
    steps: int = 0
    guidance: float = 0.0
    seed: int | None = None


# The most choices one request may ask for (``n`` times its prompts).
MAX_CHOICES = 128


class ChoiceGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``n`` choices of one prompt, queued one request each: a worker
    that takes several of them prefills the prompt once and samples each
    choice from it."""

    id: str
    size: int


class GenerateRequest(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    request_id: str
    model: str
    messages: list[ChatMessage]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # A completion's prompt (/v1/completions): text or token ids, taken as
    # they are, no chat template; ``messages`` is then empty.
    prompt: str | list[int] | None = None
    stream: bool = True
    # None: chunks go to mmpipe.<ns>.reply.<request_id>, captured by the reply
    # stream (exactly-once relay). A caller's own subject gets core-NATS delivery.
    reply_subject: str | None = None
    # Absolute deadline, Unix seconds; 0 means none.
    deadline: float = 0.0
    # Hops to run, e.g. ["encode+prefill+decode"]; empty lets the processor
    # choose from the deployment mode.
    route: list[str] = []
    created: float = 0.0
    # One of a prompt's ``n`` choices (the others: the same group, the same prompt).
    group: ChoiceGroup | None = None
    # A completion's prompt as input embeddings (vLLM's ``prompt_embeds``):
    # the bytes of a torch-saved or safetensors [tokens, hidden] tensor, in
    # place of ``prompt`` (stages/prompt_embeds.py).
    prompt_embeds: bytes | None = None
    # An image to draw (a route with an image-generation stage).
    image: ImageParams | None = None

"""The OpenAI chat-completions request as the bridge accepts it, and its
translation into a ``GenerateRequest``."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

import msgspec

from schemas.errors import InvalidRequest, UnsupportedMedia
from schemas.request import (
    MAX_CHOICES,
    ChatMessage,
    ChoiceGroup,
    ContentPart,
    GenerateRequest,
    ImageParams,
    ImagePart,
    ImageURL,
    SamplingParams,
    StructuredOutput,
    TextPart,
)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class OpenAIMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Unknown fields are refused (400) rather than silently ignored: a typo in
    a sampling parameter should not pass unnoticed."""

    model: str
    messages: list[OpenAIMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    min_tokens: int = 0
    ignore_eos: bool = False
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras, taken at their neutral values (vLLM's own clients send them so).
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured output extras: the current ``structured_outputs`` and the older ``guided_*``.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # A chat naming the image model: how the image stage draws its answer
    # (vLLM-Omni's extras; unset: the pipeline's size, the server's steps and guidance).
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None

    def drawing(self) -> ImageParams:
        """The image stage's parameters (its prompt: the answer; its seed: the request's)."""
        for name in ("width", "height", "num_inference_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequest(f"{name} is {value}; at least 1")
        if self.guidance_scale is not None and not self.guidance_scale > 0:
            raise InvalidRequest(f"guidance_scale is {self.guidance_scale}; above 0")
        return ImageParams(
            width=self.width or 0,
            height=self.height or 0,
            steps=self.num_inference_steps or 0,
            guidance=self.guidance_scale or 0.0,
        )

    def drawing_asked(self) -> list[str]:
        """The drawing's fields this request sets."""
        return [name for name in _DRAWING if getattr(self, name) is not None]


# A chat's fields for the image stage (ChatCompletionRequest.drawing).
_DRAWING = ("width", "height", "num_inference_steps", "guidance_scale")

REQUEST_DECODER = msgspec.json.Decoder(ChatCompletionRequest)


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``/v1/completions``: a prompt taken as it is (no chat template). Unknown
    fields are refused, as for chat."""

    model: str
    # Text, token ids, or a list of one of either (msgspec takes one list type in a union: checked below).
    prompt: str | list[Any] | None = None
    # vLLM's: base64 of a torch-saved (or safetensors) [tokens, hidden] tensor, or a list of them, in place of prompt.
    prompt_embeds: str | list[str] | None = None
    # OpenAI's default for completions (chat's is the model's room).
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)


# Choices in one request (prompts × n), as OpenAI's own cap on n.


def completion_to_generate_requests(
    body: CompletionRequest, request_id: str, created: float, deadline: float
) -> list[GenerateRequest]:
    """One request a choice: each prompt ``n`` times, choice ``i * n + j``
    the ``j``-th of prompt ``i`` (OpenAI's and vLLM's order)."""
    if body.best_of not in (None, 1, body.n):
        raise InvalidRequest("best_of is not supported (other than equal to n)")
    if body.suffix:
        raise InvalidRequest("suffix is not supported")
    embeds = _prompt_embeds(body.prompt_embeds)
    if embeds and body.prompt not in (None, "", []):
        raise InvalidRequest("give prompt or prompt_embeds, not both")
    prompts: list[str | list[int] | None] = [None] * len(embeds) if embeds else [*_prompts(body.prompt)]
    _check_choices(len(prompts) * body.n)
    if body.echo and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("echo takes a text prompt, not token ids or prompt_embeds")
    sampling = _sampling(body, body.max_tokens, _top_logprobs(body.logprobs, "logprobs"))
    if body.echo and body.logprobs is not None:
        sampling.prompt_logprobs = body.logprobs
    one = GenerateRequest(
        request_id=request_id,
        model=body.model,
        messages=[],
        sampling=sampling,
        stream=body.stream,
        deadline=deadline,
        created=created,
    )
    return [
        choice
        for i, prompt in enumerate(prompts)
        for choice in fan_out(
            msgspec.structs.replace(one, prompt=prompt, prompt_embeds=embeds[i] if embeds else None),
            body.n,
            first=i * body.n,
        )
    ]


def fan_out(gen: GenerateRequest, n: int, first: int = 0) -> list[GenerateRequest]:
    """``n`` requests for ``n`` choices of one prompt: choice 0 of a request
    keeps its id (a request of one choice is unchanged), choice ``k`` is
    ``<id>-<k>``; with a seed, choice ``k`` samples with ``seed + k``, as vLLM's
    parallel sampling does, so the choices differ and each is reproducible.
    They share a ``ChoiceGroup``: a worker that takes several prefills the
    prompt once."""
    out = []
    group = ChoiceGroup(f"{gen.request_id}#{first}", n) if n > 1 else None
    for k in range(first, first + n):
        sampling = gen.sampling
        if sampling.seed is not None and k:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + k)
        rid = gen.request_id if k == 0 else f"{gen.request_id}-{k}"
        out.append(msgspec.structs.replace(gen, request_id=rid, sampling=sampling, group=group))
    return out


def _check_choices(count: int) -> None:
    if not 1 <= count <= MAX_CHOICES:
        raise InvalidRequest(f"n (times the prompts) must be between 1 and {MAX_CHOICES}; it is {count}")


_MEDIA_PART_TYPES = ("image_embeds", "video_url", "audio_url", "input_audio")


def _part(i: int, j: int, raw: dict[str, Any]) -> ContentPart:
    kind = raw.get("type")
    where = f"messages[{i}].content[{j}]"
    if kind == "text":
        text = raw.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.text must be a string")
        return TextPart(text)
    if kind == "image_url":
        image = raw.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"{where}.image_url.url must be a non-empty string")
        detail = image.get("detail") if isinstance(image, dict) else None
        return ImagePart(ImageURL(url=url, detail=detail if isinstance(detail, str) else None))
    if kind in _MEDIA_PART_TYPES:
        # Whether the deployment takes this modality is the processor's call
        # (it knows the model and the --modalities switch); here only the shape.
        try:
            return msgspec.convert(raw, ContentPart)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"{where}: {exc}") from None
    if kind == "file":
        raise UnsupportedMedia(f"{where}: file input is not supported")
    raise InvalidRequest(
        f"{where}.type {kind!r} is not one of text, image_url, image_embeds, video_url, audio_url, input_audio"
    )


# As vLLM's default --max-logprobs.
MAX_LOGPROBS = 20


def _top_logprobs(top: int | None, name: str) -> int | None:
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be between 0 and {MAX_LOGPROBS}; it is {top}")
    return top


def _sampling(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The sampling fields chat and completions share, OpenAI's defaults filled in."""
    return SamplingParams(
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        stop_token_ids=list(body.stop_token_ids or []),
        structured=_structured(body),
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON keys, strings) to a bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise InvalidRequest(f"logit_bias: {key!r} is not a token id")
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest(f"logit_bias: the bias of token {key} must be within [-100, 100], got {value}")
        out[int(key)] = float(value)
    return out


def _structured(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The one structured output a request asks for, by OpenAI's
    ``response_format`` or vLLM's ``structured_outputs`` or ``guided_*``."""
    asked: list[StructuredOutput] = []
    if body.response_format is not None:
        asked += _response_format(body.response_format)
    if body.structured_outputs is not None:
        asked += _structured_outputs(body.structured_outputs)
    if body.guided_json is not None:
        asked.append(StructuredOutput("json", _schema_text(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        asked.append(StructuredOutput("regex", body.guided_regex))
    if body.guided_choice is not None:
        asked.append(StructuredOutput("choice", msgspec.json.encode(body.guided_choice).decode()))
    if body.guided_grammar is not None:
        asked.append(StructuredOutput("grammar", body.guided_grammar))
    if len(asked) > 1:
        raise InvalidRequest("ask for one structured output: " + ", ".join(a.kind for a in asked))
    return asked[0] if asked else None


def _response_format(fmt: dict[str, Any]) -> list[StructuredOutput]:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return []
    if kind == "json_object":
        return [StructuredOutput("json_object")]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise InvalidRequest("response_format.json_schema.schema is required")
        return [StructuredOutput("json", _schema_text(schema, "response_format.json_schema.schema"))]
    raise InvalidRequest(f"response_format.type {kind!r} is not one of text, json_object, json_schema")


_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _structured_outputs(spec: dict[str, Any]) -> list[StructuredOutput]:
    if unknown := sorted(set(spec) - {*_STRUCTURED_KEYS, "disable_any_whitespace"}):
        raise InvalidRequest(f"structured_outputs: {', '.join(unknown)} not supported (one of {_STRUCTURED_KEYS})")
    compact = spec.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise InvalidRequest("structured_outputs.disable_any_whitespace must be true or false")
    out = []
    for key in _STRUCTURED_KEYS:
        value = spec.get(key)
        if value is None or value is False:
            continue
        if key == "json":
            out.append(StructuredOutput("json", _schema_text(value, "structured_outputs.json"), compact))
        elif key == "json_object":
            out.append(StructuredOutput("json_object", compact=compact))
        elif key == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequest("structured_outputs.choice: a non-empty list of strings")
            out.append(StructuredOutput("choice", msgspec.json.encode(value).decode()))
        elif not isinstance(value, str):
            raise InvalidRequest(f"structured_outputs.{key} must be a string")
        else:
            out.append(msgspec.convert({"kind": key, "text": value}, StructuredOutput))
    return out


def _schema_text(schema: Any, where: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"{where} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON object")
    return msgspec.json.encode(schema).decode()


def _check_unsupported(body: ChatCompletionRequest) -> None:
    _check_choices(body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs set to true")
    if body.tools or body.tool_choice not in (None, "none"):
        raise InvalidRequest("tools are not supported")


def to_generate_requests(
    body: ChatCompletionRequest, request_id: str, created: float, deadline: float
) -> list[GenerateRequest]:
    """One request a choice (``n``): see ``fan_out``."""
    return fan_out(to_generate_request(body, request_id, created, deadline), body.n)


def to_generate_request(
    body: ChatCompletionRequest, request_id: str, created: float, deadline: float
) -> GenerateRequest:
    _check_unsupported(body)
    messages: list[ChatMessage] = []
    for i, m in enumerate(body.messages):
        if m.content is None or isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content or "", name=m.name))
        else:
            parts = [_part(i, j, p) for j, p in enumerate(m.content)]
            messages.append(ChatMessage(role=m.role, content=parts, name=m.name))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerateRequest(
        request_id=request_id,
        model=body.model,
        messages=messages,
        sampling=_sampling(
            body, max_tokens, _top_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
        ),
        stream=body.stream,
        deadline=deadline,
        created=created,
    )


def _prompt_embeds(embeds: str | list[str] | None) -> list[bytes]:
    """The bytes of each prompt's embeddings, from base64 (what they hold
    is the processor's to check)."""
    if embeds is None:
        return []
    items = [embeds] if isinstance(embeds, str) else embeds
    if not items:
        raise InvalidRequest("prompt_embeds: a base64 string or a non-empty list of them")
    try:
        return [base64.b64decode(item, validate=True) for item in items]
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"prompt_embeds is not base64: {exc}") from None


def _prompts(prompt: str | list[Any] | None) -> list[str | list[int]]:
    """The request's prompts: text or token ids, one or a list of either."""
    if prompt is None:
        raise InvalidRequest("prompt (or prompt_embeds) is required")
    if isinstance(prompt, str) or (prompt and _token_ids(prompt)):
        return [prompt]
    if not prompt or not all(isinstance(p, str) or (isinstance(p, list) and p and _token_ids(p)) for p in prompt):
        raise InvalidRequest("prompt: a string, a list of token ids, or a non-empty list of either")
    return list(prompt)


def _token_ids(items: list[Any]) -> bool:
    # bool is an int to Python, not a token id.
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


FinishReasonName = Literal["stop", "length"]

"""The OpenAI wire format of the HTTP gateway: request schemas, the chat template, and response/chunk builders.

Owns what an OpenAI client sends (`/v1/completions`, `/v1/chat/completions`: pydantic models, strict types, unknown
fields ignored so newer clients keep working) and what it gets back (`text_completion`, `chat.completion`,
`chat.completion.chunk`, usage, the error body). Everything here is pure: no I/O, no clock (the caller passes
`created`), no knowledge of Redis, auth or routing. Parameters the cluster cannot honour are rejected with a
message that names the field (n > 1, echo, logprobs, token-id prompts), never silently dropped; sampling knobs that
do not change what the engines do (temperature, top_p, seed, penalties, stop) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "chat_chunk",
    "chat_response",
    "chatml_prompt",
    "completion_chunk",
    "completion_response",
    "error_body",
    "usage",
    "validation_message",
]


class _Body(BaseModel):
    # strict: "5" is not an integer and 1 is not a boolean; unknown OpenAI fields (logit_bias, tools, metadata,
    # ...) are ignored so that clients sending them keep working.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False
    """Send a last chunk with `usage` (and no choices) before `[DONE]`."""


class _Sampling(_Body):
    model: str | None = Field(default=None, min_length=1, max_length=256)
    """Model name; may also come from the `X-Model` header or the token's `model` claim."""
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=128)
    """Completions per prompt; the gateway answers 400 above `gateway.max_n` (1)."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = Field(default=None, max_length=4)
    """Accepted for compatibility; the engines stop at max_tokens."""
    user: str | None = Field(default=None, max_length=256)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str = Field(max_length=16 * 1024 * 1024)
    """One prompt as text (a list holding exactly one string is accepted)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Tokens to generate at most; absent: the gateway's estimate (the user's history, else the model default)."""
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if (v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)) or any(
                isinstance(x, list) for x in v
            ):
                raise ValueError("token-id prompts are not supported; send the prompt as text")
            if len(v) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got a list of {len(v)}")
            return v[0]
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported; it must be false")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported; leave the field out")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of is not supported; it must be 1")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported; leave the field out")
        return v


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    """Text, or a list of `{"type": "text", "text": ...}` parts (joined); null only for an assistant turn."""
    name: str | None = Field(default=None, max_length=256)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise ValueError(f"content part {i} must be an object {{\"type\": \"text\", \"text\": ...}}")
            if part.get("type") != "text":
                raise ValueError(f"content part {i}: only text parts are supported, got type {part.get('type')!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"content part {i}: `text` must be a string")
            texts.append(text)
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """Preferred over `max_tokens` (newer clients send this one)."""
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported; it must be false")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("top_logprobs is not supported; leave the field out")
        return v

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def chatml_prompt(messages: list[ChatMessage]) -> str:
    """The ChatML text of a conversation, ending with the open assistant turn: this is the prompt profiled."""
    parts = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        parts.append(f"<|im_start|>{role}\n{m.content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def validation_message(e: ValidationError, limit: int = 3) -> tuple[str, str | None]:
    """A client-facing message for a body that failed validation, and the path of the first bad field."""
    errors = e.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return "request body is not valid JSON", None
    if errors and not errors[0]["loc"] and errors[0]["type"] in ("model_type", "model_attributes_type"):
        return "request body must be a JSON object", None
    lines = []
    for err in errors[:limit]:
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "field required"
        lines.append(f"{path}: {msg}" if path else msg)
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return "invalid request: " + "; ".join(lines) + more, param or None


# -- responses -------------------------------------------------------------------------------------------------------
def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    request_id: str, model: str, created: int, text: str, finish_reason: str, prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(
    request_id: str, model: str, created: int, text: str, finish_reason: str | None = None,
    usage_: dict[str, int] | None = None, with_choice: bool = True,
) -> dict[str, Any]:
    choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}] if with_choice else []
    out: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out


def chat_response(
    request_id: str, model: str, created: int, text: str, finish_reason: str, prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    request_id: str, model: str, created: int, delta: dict[str, str], finish_reason: str | None = None,
    usage_: dict[str, int] | None = None, with_choice: bool = True,
) -> dict[str, Any]:
    choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}] if with_choice else []
    out: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out

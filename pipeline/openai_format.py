"""The OpenAI wire format: request schemas, the chat template, and response/chunk builders, shared by the HTTP
gateway (workers/gateway/http.py: one request per call) and the Batch API's runner (workers/control/batches.py: one
request per line of a batch input file), so that a batch line is read and answered exactly as the live endpoint
reads and answers the same body.

Owns what an OpenAI client sends (`/v1/completions`, `/v1/chat/completions`: pydantic models, strict types, unknown
fields ignored so newer clients keep working; `parse_request`, `generation_fields`) and what it gets back
(`text_completion`, `chat.completion` from a final result: `final_body`; `chat.completion.chunk`, usage, the error
body and its type per HTTP status: `error_type`; the status a failed result is answered with: `result_error`).
Everything here is pure: no I/O, no clock (the caller passes `created`), no knowledge of Redis, auth or routing.
Parameters the cluster cannot honour are rejected with a message that names the field, never silently dropped: the
wire format's own refusals here (echo, suffix, best_of, token-id prompts, logit_bias, the legacy `functions`), and
the sampler's per engine in the gateway (`pipeline.sampling`: what each engine honours of stop, seed, temperature,
top_p, the penalties, logprobs, response_format and tools). Fields OpenAI's API does not define are ignored, so that
clients sending vendor extensions keep working.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.errors import RackflowError
from pipeline.events import ResultEvent
from pipeline.sampling import LogprobEntry, Sampling, tool_mode

__all__ = [
    "ENDPOINT_KIND",
    "ERROR_TYPES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "FinalChoice",
    "GenerationFields",
    "RequestFormatError",
    "StreamOptions",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "chatml_prompt",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "error_body",
    "error_type",
    "final_body",
    "finish_reason",
    "generation_fields",
    "parse_request",
    "parse_tool_calls",
    "rejected_param",
    "result_error",
    "tool_finish",
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
    """Completions per prompt (each its own sequence); the gateway answers 400 above `gateway.max_n`."""
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = Field(default=None, max_length=4)
    """Up to 4 strings that end the answer (not included in it; finish_reason `stop`)."""
    user: str | None = Field(default=None, max_length=256)
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    """OpenAI's processing tier, read as a priority class (docs/PRIORITY.md): `flex` runs as `batch`, `priority`
    as `interactive`; `auto`, `default` or absent: no choice of its own."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_texts(cls, v: list[str] | None) -> list[str] | None:
        if v and any(not x for x in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported; leave the field out")
        return v

    def _sampling(self, logprobs: int | None, **extra: Any) -> Sampling:
        return Sampling(stop=tuple(self.stop or ()), seed=self.seed, temperature=self.temperature, top_p=self.top_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        logprobs=logprobs, **extra)

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
    logprobs: int | None = Field(default=None, ge=0, le=5)
    """The chosen token's log probability and this many alternatives (engines that have logits only)."""
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

    def sampling(self) -> Sampling:
        return self._sampling(self.logprobs)

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
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    """An assistant turn's tool calls (`{"id", "type": "function", "function": {"name", "arguments"}}`)."""
    tool_call_id: str | None = Field(default=None, max_length=256)
    """A tool turn: the call it answers."""

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, call in enumerate(v or ()):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments"), str):
                raise ValueError(f"tool call {i} needs a `function` with a string `name` and string `arguments`")
        return v

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
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("response_format")
    @classmethod
    def _format_type(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("type must be one of text, json_object, json_schema")
        if v is not None and v.get("type") == "json_schema" and not isinstance(v.get("json_schema"), dict):
            raise ValueError("a json_schema response_format needs a `json_schema` object")
        return v

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, v: Any) -> Any:
        if v:
            raise ValueError("the legacy functions/function_call are not supported; send tools/tool_choice")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        names = set()
        for i, tool in enumerate(v or ()):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict):
                raise ValueError(f"tool {i}: only function tools are supported "
                                 '({"type": "function", "function": {"name": ..., "parameters": ...}})')
            name = fn.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
                raise ValueError(f"tool {i}: function.name must be 1-64 letters, digits, _ or -")
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tool {i} ({name}): function.parameters must be a JSON schema object")
            if name in names:
                raise ValueError(f"tool {i}: the function name {name!r} is given twice")
            names.add(name)
        return v

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, {t["function"]["name"] for t in self.tools or ()}
        if choice is None or choice in ("none", "auto"):
            return self
        if not self.tools:
            raise ValueError("tool_choice other than none needs tools")
        named = isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and choice["function"].get("name") in names
        if choice != "required" and not named:
            raise ValueError('tool_choice must be none, auto, required, or {"type": "function", "function": '
                             f'{{"name": N}}}} with N one of the tools ({", ".join(sorted(names))})')
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format and a forced tool_choice both constrain the answer; send one of them")
        return self

    def sampling(self) -> Sampling:
        return self._sampling((self.top_logprobs or 0) if self.logprobs else None,
                              response_format=self.response_format, tools=tuple(self.tools or ()),
                              tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)


def _tool_call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    try:
        args: Any = json.loads(fn["arguments"])
    except ValueError:
        args = fn["arguments"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def chatml_prompt(messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> str:
    """The ChatML text of a conversation, ending with the open assistant turn: this is the prompt profiled.

    With tools, the conversation is written as Qwen2.5's chat template writes it (the hermes tool format): the
    function signatures in the system turn, an assistant's calls as `<tool_call>` blocks, and the tool turns' answers
    as `<tool_response>` blocks in a user turn."""
    parts = []
    msgs = list(messages)
    if tools:
        sig = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        if msgs and msgs[0].role in ("system", "developer"):
            head = (msgs[0].content or "") + "\n\n"
            msgs = msgs[1:]
        else:
            head = ""
        parts.append(f"<|im_start|>system\n{head}{_TOOLS_HEADER}{sig}{_TOOLS_FOOTER}<|im_end|>\n")
    for k, m in enumerate(msgs):
        role = "system" if m.role == "developer" else m.role
        if role == "tool":
            first = k == 0 or msgs[k - 1].role != "tool"
            last = k == len(msgs) - 1 or msgs[k + 1].role != "tool"
            parts.append(("<|im_start|>user" if first else "") + f"\n<tool_response>\n{m.content or ''}\n"
                         "</tool_response>" + ("<|im_end|>\n" if last else ""))
            continue
        text = m.content or ""
        if role == "assistant" and m.tool_calls:
            text = "\n".join(([text] if text else []) + [_tool_call_text(c) for c in m.tool_calls])
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_tool_calls(text: str, sampling: Sampling, request_id: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer as (content, tool calls) under the request's tool mode (`pipeline.sampling.tool_mode`):
    - `named`: the text is the function's arguments (a grammar made it one JSON object);
    - `required`: a JSON array of `{"name", "parameters"}` (a grammar made it so);
    - `auto`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (the hermes format, as vLLM's
      `hermes` tool parser reads them); the text before the first block is the content, a block that is not such
      JSON stays in the content.
    An answer cut by max_tokens before its JSON closed is returned as content, with no call (as vLLM's server
    does). Call ids are `call_` + the request id and the call's position, so a resumed answer keeps them."""
    mode = tool_mode(sampling)

    def call(j: int, name: str, args: Any) -> dict[str, Any]:
        return {"id": f"call_{request_id.replace('-', '')[:20]}{j}", "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else
                             json.dumps(args, ensure_ascii=False)}}

    if mode == "none":
        return text, []
    if mode in ("named", "required"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return text, []
        if mode == "named":
            return ("", [call(0, sampling.tool_choice["function"]["name"], parsed)]) if isinstance(parsed, dict) \
                else (text, [])
        if not isinstance(parsed, list) or not all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                                   for x in parsed):
            return text, []
        return "", [call(j, x["name"], x.get("parameters", {})) for j, x in enumerate(parsed)]
    calls: list[dict[str, Any]] = []
    known = {t["function"]["name"] for t in sampling.tools}
    start = None
    for m in _HERMES_CALL.finditer(text):
        body = (m.group(1) if m.group(1) is not None else m.group(2) or "").strip()
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in known:
            continue
        start = m.start() if start is None else start
        calls.append(call(len(calls), obj["name"], obj.get("arguments", {})))
    if not calls:
        return text, []
    content = text[:start].strip()
    return (content or None), calls


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


ENDPOINT_KIND = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
"""The generation endpoints and the kind of request each takes (`chat` or `completion`)."""


class RequestFormatError(RackflowError, ValueError):
    """A body that is not a valid request of its endpoint (the client's mistake: a 400). The message says what to
    change; `param` names the first bad field, `code` is OpenAI's (`invalid_json` or `invalid_value`)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def parse_request(kind: str, raw: bytes | str) -> ChatCompletionRequest | CompletionRequest:
    """The body of a `chat` or `completion` request (JSON text), validated; RequestFormatError otherwise."""
    try:
        if kind == "chat":
            return ChatCompletionRequest.model_validate_json(raw)
        return CompletionRequest.model_validate_json(raw)
    except ValidationError as e:
        message, param = validation_message(e)
        raise RequestFormatError(message, param, "invalid_json" if message.startswith("request body") else
                                 "invalid_value") from None


@dataclass(frozen=True, slots=True)
class GenerationFields:
    """What a validated body gives the request's profile: the prompt profiled (a chat's ChatML text), the output
    limit the client set (None: the room left in the context), and the sampling parameters."""

    prompt: str
    max_tokens: int | None
    sampling: Sampling


def generation_fields(body: ChatCompletionRequest | CompletionRequest) -> GenerationFields:
    if isinstance(body, ChatCompletionRequest):
        return GenerationFields(chatml_prompt(body.messages, body.tools), body.output_limit, body.sampling())
    return GenerationFields(body.prompt, body.max_tokens, body.sampling())


def rejected_param(body: ChatCompletionRequest | CompletionRequest, param: str | None,
                   message: str) -> tuple[str | None, str]:
    """A profile refusal's (param, message) in the words of the body the client sent: a chat request's output limit
    is the field it set (`max_completion_tokens` or `max_tokens`), and its prompt is its `messages`."""
    if isinstance(body, ChatCompletionRequest) and param == "max_tokens":
        return body.output_limit_param, message
    if isinstance(body, ChatCompletionRequest) and param == "prompt":
        return "messages", message.replace("prompt", "messages")
    return param, message


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
    completion_tokens: int, logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(
    request_id: str, model: str, created: int, text: str, finish_reason: str | None = None,
    usage_: dict[str, int] | None = None, with_choice: bool = True, logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choices = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}] if with_choice \
        else []
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
    request_id: str, model: str, created: int, text: str | None, finish_reason: str, prompt_tokens: int,
    completion_tokens: int, logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text,
                            **({"tool_calls": tool_calls} if tool_calls else {})},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(
    request_id: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None,
    usage_: dict[str, int] | None = None, with_choice: bool = True, logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choices = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}] if with_choice \
        else []
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


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """OpenAI's `choices[].logprobs` of a chat completion (or of one chunk): per token its text, log probability,
    UTF-8 bytes and the `top_logprobs` alternatives."""
    return {"content": [
        {"token": tok, "logprob": lp, "bytes": list(tok.encode()),
         "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in alts]}
        for lp, tok, alts in entries]}


def completion_logprobs(entries: list[LogprobEntry], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' `choices[].logprobs`: parallel lists of tokens, their log probabilities, the
    alternatives ({text: log probability}) and each token's offset in the text, counted from `offset`."""
    offsets = []
    for _lp, tok, _alts in entries:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": [tok for _lp, tok, _alts in entries], "token_logprobs": [lp for lp, _tok, _alts in entries],
            "top_logprobs": [dict(alts) for _lp, _tok, alts in entries], "text_offset": offsets}


ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # OpenAI's type for an unknown model, file or batch (code: model_not_found, ...)
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
"""The error body's `type` of each HTTP status (OpenAI's names); any other status is a `server_error`."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error")


def result_error(result: ResultEvent) -> tuple[int, str, str]:
    """(HTTP status, message, code) of a request that ended without `ok`, as the live endpoint answers it: 409 for a
    cancelled request, 503 when no node could serve it, 502 for a failure in the cluster."""
    msg = result.error or "the request failed"
    if result.status == "cancelled":
        return 409, f"the request was cancelled: {msg}", "request_cancelled"
    if "no healthy" in msg:
        return 503, msg, "no_capacity"
    return 502, f"the request failed in the cluster: {msg}", "upstream_error"


def finish_reason(result: ResultEvent, max_tokens: int) -> str:
    """OpenAI's finish_reason: `stop` when the sequence ended on its own (an end-of-sequence token or a stop
    string), `length` when it reached max_tokens (or the context), as the worker reported it; a result without the
    report (from a worker older than the field) falls back to the token count against the request's `max_tokens`."""
    if result.finish_reason in ("stop", "length"):
        return result.finish_reason
    return "length" if result.out_tokens >= max_tokens else "stop"


def tool_finish(sampling: Sampling, finish: str, calls: list[dict[str, Any]]) -> str:
    """OpenAI's finish_reason with tools (as vLLM's server reports it): `tool_calls` when the model called tools
    under `auto`, or under `required` and ended on its own; a named function's call ends with `stop`."""
    mode = tool_mode(sampling)
    if calls and (mode == "auto" or (mode == "required" and finish == "stop")):
        return "tool_calls"
    return finish


@dataclass(frozen=True, slots=True)
class FinalChoice:
    """One choice of a finished request: its own request id (a choice is a sequence of its own), its whole text,
    its finish_reason (`finish_reason`) and its formatted logprobs (None: not asked for)."""

    request_id: str
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None


def final_body(kind: str, request_id: str, model: str, created: int, choices: Sequence[FinalChoice],
               sampling: Sampling | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) answer of a `chat` or `completion` request: `chat.completion` or `text_completion`
    with one choice per entry of `choices`, in order, and the request's usage. A chat answer under a tool mode is
    parsed into its tool calls (`parse_tool_calls`), its finish_reason set as vLLM's server sets it."""
    body: dict[str, Any] = {}
    for i, c in enumerate(choices):
        pt, ct = (prompt_tokens, completion_tokens) if i == 0 else (0, 0)
        if kind == "chat":
            text: str | None = c.text
            finish = c.finish_reason
            calls: list[dict[str, Any]] = []
            if sampling is not None and tool_mode(sampling) != "none":
                text, calls = parse_tool_calls(c.text, sampling, c.request_id)
                finish = tool_finish(sampling, finish, calls)
            one = chat_response(request_id, model, created, text, finish, pt, ct, c.logprobs, calls)
        else:
            one = completion_response(request_id, model, created, c.text, c.finish_reason, pt, ct, c.logprobs)
        if i == 0:
            body = one
        else:
            one["choices"][0]["index"] = i
            body["choices"].append(one["choices"][0])
    return body

"""What a client asked of the sampler, carried from the gateway to the engine, and which engine honours what.

The OpenAI parameters that change the tokens (`stop`, `seed`, `temperature`, `top_p`, the penalties, `logprobs`,
`response_format`, `tools`) ride on the request as one compact JSON string (`RequestEvent.sampling`, empty when the
client sent none of them), read only by the worker that runs the sequence: profiling, routing and batching never
parse it. `n` never reaches an engine: the gateway runs n sequences (`n_choices`).

Every parameter is honoured or refused; none is ignored. `ENGINE_PARAMS` says which engine honours which, the
gateway answers 400 naming a parameter the cluster's engine does not honour, and a worker whose engine is asked for
one anyway (a mixed cluster, an old gateway) fails the request with the same message rather than drop it. A value
that leaves the sampler as it is (`top_p` 1, a penalty 0, `logprobs` false) is no request at all and passes on
every engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.errors import RackflowError

__all__ = [
    "ENGINE_PARAMS", "PARAM_NOTES", "LogprobEntry", "Sampling", "SamplingRefused", "check_engine", "decode",
    "decode_logprobs", "encode", "encode_logprobs", "tool_call_schema", "tool_mode",
]


class SamplingRefused(RackflowError, ValueError):
    """The engine cannot honour a parameter the client set; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Sampling:
    stop: tuple[str, ...] = ()
    """Strings that end the answer; the answer excludes the stop string (OpenAI's and vLLM's rule)."""
    seed: int | None = None
    temperature: float | None = None
    """None: the engine's default (1.0 in OpenAI's API)."""
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    """None: none; k >= 0: the chosen token's log probability and the k most likely alternatives."""
    response_format: dict[str, Any] | None = None
    """`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {...}}` (guided decoding)."""
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = None
    """`none`, `auto` (the default with tools), `required`, or `{"type": "function", "function": {"name": N}}`."""
    parallel_tool_calls: bool | None = None
    """False: at most one tool call (under `required`, the grammar's array holds one item)."""

    def asked(self) -> list[str]:
        """The parameters this asks of the sampler, in OpenAI's names (values that change nothing left out)."""
        out = []
        if self.stop:
            out.append("stop")
        if self.seed is not None:
            out.append("seed")
        if self.temperature is not None:
            out.append("temperature")
        if self.top_p is not None and self.top_p < 1.0:
            out.append("top_p")
        if self.presence_penalty:
            out.append("presence_penalty")
        if self.frequency_penalty:
            out.append("frequency_penalty")
        if self.logprobs is not None:
            out.append("logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            out.append("response_format")
        if self.tools and self.tool_choice != "none":
            out.append("tools")
        return out


def encode(s: Sampling) -> str:
    """The wire form: compact JSON of the fields set, "" for a request that sets none."""
    d = {k: v for k, v in asdict(s).items() if v not in (None, (), [])}
    if "stop" in d:
        d["stop"] = list(d["stop"])
    if "tools" in d:
        d["tools"] = list(d["tools"])
    return json.dumps(d, separators=(",", ":"), sort_keys=True) if d else ""


def decode(text: str) -> Sampling:
    if not text:
        return Sampling()
    d = json.loads(text)
    if not isinstance(d, dict):
        raise ValueError("sampling: expected a JSON object")
    d["stop"] = tuple(d.get("stop", ()))
    d["tools"] = tuple(d.get("tools", ()))
    known = set(Sampling.__dataclass_fields__)
    return Sampling(**{k: v for k, v in d.items() if k in known})


ENGINE_PARAMS: dict[str, frozenset[str]] = {
    # placeholder tokens (a hash of the request's seed and position): the stop string is cut by the worker, a seed
    # makes the answer a function of the seed and the prompt, temperature 0 a function of the prompt alone
    "sim": frozenset({"stop", "seed", "temperature"}),
    # a real transformer: its sampler draws from the logits (temperature, nucleus, penalties), seeded per position
    "torch": frozenset({"stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty"}),
    # vLLM's own SamplingParams (log probabilities of the raw logits, as vLLM's server reports them) and structured
    # outputs (response_format; tools under `required` or a named function, as vLLM's server constrains them)
    "vllm": frozenset({"stop", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logprobs",
                       "response_format", "tools"}),
}
"""The sampler parameters each engine honours (`n` is the gateway's on every engine)."""

PARAM_NOTES: dict[str, str] = {
    "logprobs": "log probabilities come from vLLM's sampler; this engine does not report them",
    "response_format": "guided decoding (JSON mode, JSON schema) needs vLLM's structured-output backend",
    "tools": "tool calls are served on the vllm engine (its structured outputs force a call; the answer is read for "
             "hermes <tool_call> blocks)",
    "top_p": "the sim engine's placeholder tokens have no distribution to cut",
    "presence_penalty": "the sim engine's placeholder tokens have no logits to penalise",
    "frequency_penalty": "the sim engine's placeholder tokens have no logits to penalise",
}


def check_engine(s: Sampling, engine: str) -> None:
    """Raise SamplingRefused naming the first parameter `engine` does not honour."""
    honoured = ENGINE_PARAMS.get(engine, frozenset())
    for param in s.asked():
        if param not in honoured:
            why = PARAM_NOTES.get(param, "")
            raise SamplingRefused(
                f"{param} is not supported by this cluster's {engine} engine"
                + (f" ({why})" if why else "") + f"; leave {param} out", param)


class StopMatcher:
    """Stop strings over a stream of token texts, for the engines that do not stop on strings themselves.

    `feed(text)` returns the text that may go to the client now and whether a stop string completed. Text that could
    still be the start of a stop string is held back (a client never sees part of a stop string); a completed one is
    cut with everything after it. `flush()` releases what is held when the sequence ends without a stop."""

    __slots__ = ("_held", "_longest", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return buf[:cut], True
        # hold the longest tail of buf that is a proper prefix of some stop string
        keep = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


LogprobEntry = tuple[float, str, tuple[tuple[str, float], ...]]
"""One token's log probability, its text, and the alternatives' (text, log probability), best first."""


def encode_logprobs(entries: list[LogprobEntry]) -> str:
    """The wire form of a token chunk's log probabilities (`TokenEvent.logprobs`)."""
    return json.dumps([[lp, tok, [list(a) for a in alts]] for lp, tok, alts in entries], separators=(",", ":"))


def decode_logprobs(text: str) -> list[LogprobEntry]:
    if not text:
        return []
    return [(float(lp), str(tok), tuple((str(a), float(b)) for a, b in alts)) for lp, tok, alts in json.loads(text)]


def tool_mode(s: Sampling) -> str:
    """How the answer becomes tool calls: `none` (no tools, or tool_choice none), `auto` (the model may call them:
    the hermes format, `<tool_call>{...}</tool_call>`), `required` (a grammar: a JSON array of one or more
    `{"name", "parameters"}`) or `named` (a grammar: the named function's arguments as one JSON object)."""
    if not s.tools or s.tool_choice == "none":
        return "none"
    if s.tool_choice in (None, "auto"):
        return "auto"
    if s.tool_choice == "required":
        return "required"
    return "named"


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def tool_call_schema(s: Sampling) -> dict[str, Any] | None:
    """The JSON schema that forces a tool call (vLLM's server builds the same one for its structured outputs:
    `vllm.tool_parsers.utils.get_json_schema_from_tools`); None where nothing is forced."""
    mode = tool_mode(s)
    if mode == "named":
        name = s.tool_choice["function"]["name"]
        tool = next(t for t in s.tools if t.get("function", {}).get("name") == name)
        return _params(tool)
    if mode != "required":
        return None
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _params(t)},
         "required": ["name", "parameters"]} for t in s.tools]}}
    if s.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema

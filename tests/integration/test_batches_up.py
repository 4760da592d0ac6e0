"""The OpenAI Batch API end to end, as a user runs it: `rackflow up` (a subprocess, on free ports) and the official
`openai` client. A chat batch and a completions batch run to `completed`, every custom_id exactly once in the output
file with its endpoint's body; an input with bad lines ends `failed` naming them; the list pages; a batch cancelled
while it runs reaches `cancelled` with every line that ran in exactly one file, and the cluster runs nothing more of
it."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from pipeline.events import ResultEvent
from streams import codec, keys
from streams.runner import connect
from tests.integration import harness
from workers.stores.batches import line_request_id

pytestmark = [pytest.mark.integration, pytest.mark.batch_api]

RF = [sys.executable, "-m", "workers.cli"]
MODEL = "qwen2-7b"
MAX_IN_FLIGHT = 48


@dataclass
class Up:
    url: str
    redis_url: str
    cwd: Path
    proc: subprocess.Popen[str]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="x", max_retries=2, timeout=60)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    from workers.local.supervise import free_port

    tmp = tmp_path_factory.mktemp("batches-up")
    override = tmp / "small.yaml"
    override.write_text(yaml.safe_dump({**harness.SMALL_CLUSTER,
                                        "batches": {"max_in_flight": MAX_IN_FLIGHT, "slice_s": 10}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    port, flower = free_port(), free_port()
    proc = subprocess.Popen([*RF, "--config", str(override), "--log-level", "INFO", "up", "--gateway-port",
                             str(port), "--flower-port", str(flower)], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"redis (\S+) etcd (\S+)", line)
        assert m, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        gw = proc.stdout.readline()
        found = re.search(r"gateway (http://\S+/v1)", gw)
        assert found, gw
        yield Up(found.group(1), m.group(1), tmp, proc)
        assert proc.poll() is None, "rackflow up exited while the tests ran (a role died)"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _upload(client: openai.OpenAI, rows: list[Any]) -> str:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def chat_line(i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": max_tokens,
                     "messages": [{"role": "user", "content": f"say something about the number {i}"}]}}


def completion_line(i: int) -> dict[str, Any]:
    return {"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"count to {i}", "max_tokens": 3}}


def wait_for(client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool], timeout_s: float,
              every_s: float = 0.3) -> Any:
    """Poll the batch until `done(batch)`; the last batch seen otherwise (the caller's assertion says why)."""
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if done(b) or time.monotonic() > deadline:
            return b
        time.sleep(every_s)


def final(b: Any) -> bool:
    return b.status in ("completed", "failed", "expired", "cancelled")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(ln) for ln in client.files.content(file_id).content.splitlines() if ln.strip()]


@pytest.mark.timeout(300)
def test_round_trip_with_the_official_client(up: Up) -> None:
    client = up.client()
    chat_in = _upload(client, [chat_line(i) for i in range(60)])
    cmpl_in = _upload(client, [completion_line(i) for i in range(25)])
    bad_in = _upload(client, [chat_line(0), {**chat_line(1), "url": "/v1/completions"}, '[1, 2]',
                              {k: v for k, v in chat_line(3).items() if k != "custom_id"}, chat_line(4)])
    chat = client.batches.create(input_file_id=chat_in, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"case": "chat"})
    assert (chat.object, chat.status, chat.endpoint, chat.metadata) == ("batch", "validating", "/v1/chat/completions",
                                                                        {"case": "chat"})
    cmpl = client.batches.create(input_file_id=cmpl_in, endpoint="/v1/completions", completion_window="24h")
    bad = client.batches.create(input_file_id=bad_in, endpoint="/v1/chat/completions", completion_window="24h")

    b = wait_for(client, chat.id, final, 180)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (60, 60, 0)
    assert b.error_file_id is None and b.output_file_id is not None
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.completed_at >= b.in_progress_at
    out = file_lines(client, b.output_file_id)
    assert Counter(x["custom_id"] for x in out) == Counter(f"chat-{i}" for i in range(60))
    for x in out:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        resp = x["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
        assert body["id"] == f"chatcmpl-{resp['request_id']}"
    meta = client.files.retrieve(b.output_file_id)
    assert meta.purpose == "batch_output"

    c = wait_for(client, cmpl.id, final, 120)
    assert c.status == "completed" and c.request_counts.completed == 25, c
    outs = file_lines(client, c.output_file_id)
    assert sorted(x["custom_id"] for x in outs) == sorted(f"cmpl-{i}" for i in range(25))
    assert all(x["response"]["body"]["object"] == "text_completion" and x["response"]["body"]["choices"][0]["text"]
               for x in outs)

    f = wait_for(client, bad.id, final, 60)
    assert f.status == "failed" and f.output_file_id is None and f.request_counts.total == 0, f
    errs = {e.line: e for e in f.errors.data}
    assert set(errs) == {2, 3, 4}, f.errors
    assert (errs[2].code, errs[2].param) == ("invalid_url", "url")
    assert errs[3].code == "invalid_json_line"
    assert (errs[4].code, errs[4].param) == ("missing_required_parameter", "custom_id")

    # the list, newest first, by pages
    page = client.batches.list(limit=2)
    assert [x.id for x in page.data] == [bad.id, cmpl.id] and page.has_more
    rest = client.batches.list(limit=2, after=cmpl.id)
    assert rest.data[0].id == chat.id


def _results_of(redis_url: str, rids: set[str]) -> Counter[str]:
    async def read() -> Counter[str]:
        r = connect(redis_url)
        try:
            entries = await r.xrange(keys.RESULTS)
        finally:
            await r.aclose()
        seen: Counter[str] = Counter()
        for _eid, fields in entries:
            ev = codec.decode(fields)
            if isinstance(ev, ResultEvent) and ev.request_id in rids:
                seen[ev.request_id] += 1
        return seen

    return asyncio.run(read())


def _admitted(redis_url: str, batch_id: str) -> set[int]:
    async def read() -> set[int]:
        r = connect(redis_url)
        try:
            return {int(k) for k in await r.hkeys(keys.batch_admitted(batch_id))}
        finally:
            await r.aclose()

    return asyncio.run(read())


@pytest.mark.timeout(300)
def test_cancel_halfway_keeps_what_ran_and_runs_nothing_more(up: Up) -> None:
    client = up.client()
    n = 2000  # with at most MAX_IN_FLIGHT lines admitted at a time, most are still waiting when the cancel comes
    batch = client.batches.create(input_file_id=_upload(client, [chat_line(i, max_tokens=48) for i in range(n)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    running = wait_for(client, batch.id, lambda b: final(b) or b.request_counts.completed >= 2 * MAX_IN_FLIGHT, 180)
    assert running.status == "in_progress", running
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    b = wait_for(client, batch.id, final, 120)
    assert b.status == "cancelled" and b.cancelled_at, b
    counts = b.request_counts
    assert counts.total == n and 2 * MAX_IN_FLIGHT <= counts.completed + counts.failed < n, counts

    lines = file_lines(client, b.output_file_id) + file_lines(client, b.error_file_id)
    ids = Counter(x["custom_id"] for x in lines)
    assert all(c == 1 for c in ids.values()), [k for k, c in ids.items() if c > 1][:5]
    assert len(ids) == counts.completed + counts.failed
    assert len(file_lines(client, b.output_file_id)) == counts.completed
    # a line in a file is a line that was admitted, and every admitted line is in a file
    admitted = _admitted(up.redis_url, batch.id)
    assert {f"chat-{i}" for i in admitted} == set(ids)
    # the cancelled ones ended with the live API's answer to a cancelled request
    for x in file_lines(client, b.error_file_id):
        assert x["response"]["status_code"] == 409 and x["response"]["body"]["error"]["code"] == "request_cancelled"
    # the cluster ran nothing more of it: only admitted lines ever got a result, each one result
    rids = {line_request_id(batch.id, i): i for i in range(n)}
    seen = _results_of(up.redis_url, set(rids))
    assert set(seen) <= {line_request_id(batch.id, i) for i in admitted} and all(c == 1 for c in seen.values())
    time.sleep(2.0)
    assert _results_of(up.redis_url, set(rids)) == seen, "results of the cancelled batch kept coming"
    assert client.batches.retrieve(batch.id).status == "cancelled"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(chat_batch_of(client))


def chat_batch_of(client: openai.OpenAI) -> str:
    """A completed batch of this module's cluster (the round-trip test's, or one made here)."""
    for b in client.batches.list(limit=100):
        if b.status == "completed":
            return str(b.id)
    made = client.batches.create(input_file_id=_upload(client, [chat_line(0)]), endpoint="/v1/chat/completions",
                                 completion_window="24h")
    return str(wait_for(client, made.id, final, 60).id)


def _age(redis_url: str, batch_id: str, by_s: int) -> None:
    """Move a batch's creation `by_s` into the past (its completion window with it), as the runner's clock would
    see a day go by."""
    import dataclasses

    from workers.stores.batches import BatchStore

    async def move() -> None:
        r = connect(redis_url)
        try:
            await BatchStore(r, 3600).update(batch_id, lambda b: dataclasses.replace(b, created_at=b.created_at - by_s))
        finally:
            await r.aclose()

    asyncio.run(move())


@pytest.mark.timeout(300)
def test_a_batch_past_its_window_expires_with_every_line_in_a_file(up: Up) -> None:
    client = up.client()
    n = 2000
    batch = client.batches.create(input_file_id=_upload(client, [chat_line(i, max_tokens=48) for i in range(n)]),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    running = wait_for(client, batch.id, lambda b: final(b) or b.request_counts.completed >= MAX_IN_FLIGHT, 180)
    assert running.status == "in_progress", running
    _age(up.redis_url, batch.id, 86_400)
    b = wait_for(client, batch.id, final, 120)
    assert b.status == "expired" and b.expired_at, b
    assert b.request_counts.completed + b.request_counts.failed == n and b.request_counts.completed < n, b
    out, err = file_lines(client, b.output_file_id), file_lines(client, b.error_file_id)
    ids = Counter(x["custom_id"] for x in out + err)
    assert set(ids) == {f"chat-{i}" for i in range(n)} and all(c == 1 for c in ids.values())
    expired = [x for x in err if x["response"] is None]
    assert expired and all(x["error"]["code"] == "batch_expired" for x in expired)
    assert len(out) == b.request_counts.completed

"""`/v1/files` through the official `openai` client (its `files` resource) against the gateway app, in process, on
real Valkey and etcd: upload, list, retrieve, content, delete; a tenant sees only its own files; a batch upload that
is not JSONL, an unknown purpose and an oversized file are 4xx with OpenAI's error shape; files outlive the gateway
(a new app on the same directory serves them)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from fastapi.testclient import TestClient

from pipeline.config import DEFAULT_CONFIG_DIR, RackflowConfig, load_config
from workers.local.services import ServiceEndpoints

pytestmark = pytest.mark.integration

SECRET = "files-test-secret-0123456789abcdef0123"
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "qwen2-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}


def files_config(tmp_path: Path, **gateway: Any) -> RackflowConfig:
    p = tmp_path / "files.yaml"
    p.write_text(yaml.safe_dump({
        "cluster": {"racks": [{"name": "r0", "node_count": 1,
                               "node": {"gpu": "h100-80gb", "tp": 1, "models": ["qwen2-7b"]}}]},
        "gateway": {"auth": {"mode": "hs256", "secret_env": "RACKFLOW_JWT_SECRET"},
                    "files_dir": str(tmp_path / "files"), **gateway},
    }))
    return load_config(DEFAULT_CONFIG_DIR, [p])


def client_for(config: RackflowConfig, http: TestClient, tenant: str) -> openai.OpenAI:
    from workers.gateway.auth import mint_token

    return openai.OpenAI(base_url="http://testserver/v1", api_key=mint_token(config.gateway.auth, tenant=tenant,
                                                                               sub="u1"),
                         http_client=http, max_retries=0)


def test_files_round_trip_through_the_official_client(clean_services: ServiceEndpoints, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = files_config(tmp_path)
    data = (json.dumps(LINE) + "\n" + json.dumps({**LINE, "custom_id": "b"}) + "\n").encode()
    app = create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)
    with TestClient(app) as http:
        c1, c2 = client_for(config, http, "t1"), client_for(config, http, "t2")
        f = c1.files.create(file=("batch-in.jsonl", io.BytesIO(data)), purpose="batch")
        assert (f.object, f.bytes, f.filename, f.purpose, f.status) == ("file", len(data), "batch-in.jsonl", "batch",
                                                                         "processed")
        assert f.id.startswith("file-")
        assert c1.files.retrieve(f.id).bytes == len(data)
        assert c1.files.content(f.id).content == data
        assert [x.id for x in c1.files.list()] == [f.id]

        # another tenant: nothing to see, read or delete
        assert list(c2.files.list()) == []
        for call in (lambda: c2.files.retrieve(f.id), lambda: c2.files.content(f.id), lambda: c2.files.delete(f.id)):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert e.value.status_code == 404 and "no such file object" in str(e.value).lower()

        # what the upload refuses, with OpenAI's error shape
        with pytest.raises(openai.BadRequestError) as bad:
            c1.files.create(file=("bad.jsonl", io.BytesIO(b'{"ok": 1}\n{not json\n')), purpose="batch")
        assert bad.value.body["code"] == "invalid_file_format" and "line 2" in bad.value.body["message"]
        with pytest.raises(openai.BadRequestError) as bad:
            c1.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="fine-tune")
        assert (bad.value.body["code"], bad.value.body["param"]) == ("invalid_value", "purpose")

    # a restarted gateway on the same directory still has the file; then it is deleted
    with TestClient(create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)) as http:
        c1 = client_for(config, http, "t1")
        assert c1.files.content(f.id).content == data
        d = c1.files.delete(f.id)
        assert (d.id, d.deleted) == (f.id, True)
        with pytest.raises(openai.NotFoundError):
            c1.files.retrieve(f.id)
        assert list(c1.files.list()) == []


def test_an_oversized_upload_is_413(clean_services: ServiceEndpoints, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.gateway.http import create_app

    monkeypatch.setenv("RACKFLOW_JWT_SECRET", SECRET)
    config = files_config(tmp_path, max_file_bytes=4096)
    big = ((json.dumps(LINE) + "\n") * 100).encode()
    with TestClient(create_app(config, clean_services.redis_url, clean_services.etcd_url, no_auth=False)) as http:
        c = client_for(config, http, "t1")
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
        assert e.value.status_code == 413 and "max_file_bytes" in str(e.value)
        assert list(c.files.list()) == []

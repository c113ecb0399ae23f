"""The built-in demo model, generated locally so every code path runs without a model hub.

`skulk/tiny-random-llama` is a real Hugging Face-format Llama (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML template, generation_config.json) with random weights
from a fixed seed and a byte-level tokenizer that needs no training data. It talks nonsense, but loads
through the same loader, tokenizer and chat template as a downloaded model. Generation is byte-for-byte
reproducible (sorted JSON keys, fixed safetensors metadata, a seeded CPU generator), so two nodes staging it
independently hold identical files.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from skulk.models.demo_embed import EMBED_MODEL_ID, EMBED_SEED, EMBED_SHAPE, generate_random_bert
from skulk.models.memory_math import card_memory
from skulk.models.packaged import PACKAGED, ensure_packaged_model
from skulk.store.files import model_dir_name
from skulk.types.ids import ModelId
from skulk.types.memory import Memory
from skulk.types.models import ModelCard

if TYPE_CHECKING:  # torch loads only to generate weights: the node imports this module's ids
    import torch

DEMO_MODEL_ID = ModelId("skulk/tiny-random-llama")
DEMO_SEED = 0

BOS, EOS, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # byte b has id b; specials follow in the order above
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(256, BYTE_VOCAB_SIZE)

CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools>\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}{{ '<|im_start|>assistant\\n' }}"
    "{% for call in message['tool_calls'] %}{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + "
    "'\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with Qwen's (Hermes) tool conventions: offered tools in a system block, calls as <tool_call> JSON, tool
results as <tool_response>; a conversation without tools renders exactly as plain ChatML."""

DEMO_SHAPE: dict[str, int] = {
    "hidden_size": 64, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 128,
}
# ~104M parameters: decode is weight-bandwidth bound like a real model, yet small enough for CPU CI.
BENCH_100M_SHAPE: dict[str, int] = {
    "hidden_size": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "intermediate_size": 3072,
}

# ~720M parameters (16 layers of a 1B-class Llama: hidden 2048, 5632-wide MLP): a token takes tens of ms on one
# core, the regime a split is for, where bench/split.py's hops are small against the compute.
BENCH_700M_SHAPE: dict[str, int] = {
    "hidden_size": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 4, "intermediate_size": 5632,
}

BENCH_MODEL_ID = ModelId("skulk/bench-random-100m")
BENCH_700M_MODEL_ID = ModelId("skulk/bench-random-700m")
BENCH_SEED = 1
BUILTIN_MODELS: dict[str, tuple[dict[str, int], int]] = {
    DEMO_MODEL_ID: (DEMO_SHAPE, DEMO_SEED),
    BENCH_MODEL_ID: (BENCH_100M_SHAPE, BENCH_SEED),
    BENCH_700M_MODEL_ID: (BENCH_700M_SHAPE, BENCH_SEED),
}
"""Models any node can generate on first need instead of downloading: same bytes on every machine."""

_WEIGHT_STD = 0.02
_MAX_POSITIONS = 2048


def ensure_demo_model(models_dir: Path) -> Path:
    """The demo model's directory under models_dir, generated on first use."""
    return ensure_builtin_model(DEMO_MODEL_ID, models_dir)


def is_builtin(model_id: str) -> bool:
    """Every node obtains this model itself (generated, or fetched from the package index), never via the store."""
    return model_id in BUILTIN_MODELS or model_id in PACKAGED or model_id == EMBED_MODEL_ID


def ensure_builtin_model(model_id: str, models_dir: Path) -> Path:
    """A built-in model's directory under models_dir, generated (or, for a packaged real model, fetched) on
    first use.

    Generation goes to a temporary sibling directory that is renamed into place, so a crash or a concurrent
    caller never sees a half-written model: the directory either exists complete or not at all.
    """
    if model_id in PACKAGED:
        return ensure_packaged_model(model_id, models_dir)
    target = models_dir / model_dir_name(model_id)
    if target.is_dir():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-builtin-", dir=models_dir))
    try:
        _generate(model_id, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a staged model is readable like any other
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # a concurrent caller winning the rename is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _generate(model_id: str, path: Path) -> None:
    """The built-in model's files: the embedding demo is a sentence encoder, the others random Llamas."""
    if model_id == EMBED_MODEL_ID:
        generate_random_bert(path, seed=EMBED_SEED, **EMBED_SHAPE)
        return
    shape, seed = BUILTIN_MODELS[model_id]
    generate_random_llama(path, seed=seed, **shape)


@functools.cache
def demo_card() -> ModelCard:
    """The demo model's card; storage size is measured from a real generation, not estimated, and its per-layer
    memory is its config's arithmetic (as the catalogue's card carries it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        generate_random_llama(path, seed=DEMO_SEED, **DEMO_SHAPE)
        size = sum(f.stat().st_size for f in path.iterdir())
    return ModelCard(
        model_id=DEMO_MODEL_ID,
        family="llama",
        n_layers=DEMO_SHAPE["n_layers"],
        hidden_size=DEMO_SHAPE["hidden_size"],
        num_attention_heads=DEMO_SHAPE["n_heads"],
        num_key_value_heads=DEMO_SHAPE["n_kv_heads"],
        storage_size=Memory.from_bytes(size),
        dtype="float32",
        context_length=_MAX_POSITIONS,
        vocab_size=BYTE_VOCAB_SIZE,
        memory=card_memory(_llama_config(**DEMO_SHAPE), size),
        supports_tensor=True,
        mlx_splits=["Pipeline", "Tensor"],  # mlx-lm's llama has shard() and a uniform stack
        builtin=True,
    )


def generate_random_llama(
    path: Path,
    *,
    hidden_size: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    intermediate_size: int,
    seed: int,
) -> Path:
    """Write a random-weight LlamaForCausalLM with the byte tokenizer into path (created if needed).

    The vocabulary is the byte tokenizer's, so any shape gets a working tokenizer and chat template;
    benchmarks use this with a bigger shape to get realistic per-token compute.
    """
    if hidden_size % n_heads or n_heads % n_kv_heads:
        raise ValueError("hidden_size must divide into n_heads, and n_heads into n_kv_heads")
    path.mkdir(parents=True, exist_ok=True)
    config = _llama_config(hidden_size, n_layers, n_heads, n_kv_heads, intermediate_size)
    _write_json(path / "config.json", config)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]}
    _write_json(path / "generation_config.json", generation)
    from safetensors.torch import save_file

    save_file(_random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "tokenizer.json", json.loads(byte_tokenizer().to_str()))
    _write_json(path / "tokenizer_config.json", _tokenizer_config())
    return path


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE with one token per byte and no merges: covers all of UTF-8 without training data."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map, which the ByteLevel pre-tokenizer/decoder assume."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _MAX_POSITIONS,
    }


def _llama_config(
    hidden_size: int, n_layers: int, n_heads: int, n_kv_heads: int, intermediate_size: int
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "head_dim": hidden_size // n_heads,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": _WEIGHT_STD,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": _MAX_POSITIONS,
        "mlp_bias": False,
        "num_attention_heads": n_heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": BYTE_VOCAB_SIZE,
    }


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Weights drawn in a fixed name order from one seeded CPU generator; norms are ones, as at HF init."""
    import torch

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (q_dim, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_dim)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.float32)
        else:
            weights[name] = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(_WEIGHT_STD)
    return weights


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")

"""The built-in demo model: reproducible bytes, a real Llama config, a working byte tokenizer and template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from skulk.models.cards import get_card
from skulk.models.demo import DEMO_MODEL_ID, demo_card, ensure_demo_model, generate_random_llama


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("models"))


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_generation_is_byte_for_byte_reproducible(tmp_path: Path, demo_dir: Path) -> None:
    again = ensure_demo_model(tmp_path / "elsewhere")
    assert again.name == "skulk--tiny-random-llama"
    assert set(_digests(again)) == {
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    }
    assert _digests(again) == _digests(demo_dir)


def test_different_seed_gives_different_weights(tmp_path: Path, demo_dir: Path) -> None:
    other = generate_random_llama(
        tmp_path / "m", hidden_size=64, n_layers=8, n_heads=4, n_kv_heads=2, intermediate_size=128, seed=1
    )
    assert _digests(other)["config.json"] == _digests(demo_dir)["config.json"]
    assert _digests(other)["model.safetensors"] != _digests(demo_dir)["model.safetensors"]


def test_ensure_is_idempotent_and_leaves_no_temp_dirs(tmp_path: Path) -> None:
    first = ensure_demo_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_config_is_an_eight_layer_llama(demo_dir: Path) -> None:
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] >= 8
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert config["torch_dtype"] == "float32"
    assert config["max_position_embeddings"] == 2048


def test_weights_use_hugging_face_names(demo_dir: Path) -> None:
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (32, 64)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert "model.layers.7.mlp.down_proj.weight" in names
    assert "model.layers.8.mlp.down_proj.weight" not in names
    assert len(names) == 3 + 8 * 9


@pytest.mark.parametrize("text", ["hello world", "héllo wörld ✓", "emoji 🦊🚀 and 中文", "\x00\n\t<|im_end|"])
def test_tokenizer_round_trips_utf8(demo_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one token per byte, id == byte value
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(demo_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)
    assert tok.encode("<|im_start|>x<|im_end|>", add_special_tokens=False) == [258, ord("x"), 259]
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)


def test_chat_template_renders_chatml(demo_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 🦊"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi 🦊<|im_end|>\n<|im_start|>assistant\n"
    )


def test_demo_card_matches_generated_files_and_catalogue(demo_dir: Path) -> None:
    card = demo_card()
    assert card.model_id == DEMO_MODEL_ID
    assert card.builtin and card.supports_tensor and card.dtype == "float32"
    assert card.storage_size.in_bytes == sum(f.stat().st_size for f in demo_dir.iterdir())
    assert get_card(DEMO_MODEL_ID) == card

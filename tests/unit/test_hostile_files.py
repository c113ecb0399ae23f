"""Model files read with bounds (issue 38): hostile GGUF, safetensors and config.json files are refused with
InvalidModelFile naming what is wrong, quickly and without allocating what they claim; the seeded fuzzers see
nothing else, and whatever they let through the real readers (the gguf package, safetensors) read."""

from __future__ import annotations

import asyncio
import random
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from safetensors import safe_open

from skulk.engines.torch.gguf_file import read_layout
from skulk.formats import InvalidModelFile
from skulk.formats.checkpoint import MAX_CONFIG, parse_config, read_config, safetensors_header
from skulk.formats.gguf_header import MAX_ELEMENTS, MAX_STRING, check_gguf
from skulk.models.catalog import UnsupportedArchitecture, card_from_config
from skulk.models.gguf_import import import_gguf
from skulk.models.import_worker import import_in_child
from skulk.types.errors import ApiError, ErrorCode

from .hostile_files import (
    CONFIG,
    GGUF_ARRAY,
    GGUF_U32,
    config_bytes,
    gguf_bytes,
    gguf_kv_string,
    gguf_kv_strings,
    gguf_kv_u32,
    gguf_string,
    mutate,
    safetensors_bytes,
    write,
)

pytestmark = pytest.mark.timeout(60)
BIG = 50 << 20


def refused(path: Path, match: str) -> None:
    with pytest.raises(InvalidModelFile, match=match):
        check_gguf(path)


def test_what_the_gguf_package_writes_passes(tmp_path: Path) -> None:
    """No false refusals: a file with a tokenizer's arrays, a custom alignment and quantized blocks."""
    path = tmp_path / "w.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_token_list([f"tok{i}" for i in range(1000)])
    writer.add_token_scores([0.5] * 1000)
    writer.add_token_merges(["t o", "o k"])
    writer.add_chat_template("{{ messages }}" * 100)
    writer.add_tensor("token_embd.weight", np.zeros((4, 18 * 2), np.uint8), raw_dtype=QT.Q4_0)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = check_gguf(path)
    assert header.alignment == 64 and header.tensor_count == 2
    assert set(read_layout(path)["tensors"]) == {"token_embd.weight", "output_norm.weight"}


def test_every_truncation_of_a_gguf_file_is_refused(tmp_path: Path) -> None:
    data = gguf_bytes()
    for cut in range(len(data)):
        with pytest.raises(InvalidModelFile):
            check_gguf(write(tmp_path / "t.gguf", data[:cut]))


@pytest.mark.parametrize("field", ["tensor_count", "kv_count"])
def test_a_2_63_count_is_refused_before_anything_is_read(tmp_path: Path, field: str) -> None:
    refused(write(tmp_path / "c.gguf", gguf_bytes(**{field: 2**63})), "count is 9223372036854775808")


def test_a_2_62_string_length_is_refused(tmp_path: Path) -> None:
    kv = gguf_string("general.name") + struct.pack("<IQ", 8, 2**62) + b"x" * 16
    refused(write(tmp_path / "s.gguf", gguf_bytes([kv])), "4611686018427387904 bytes long")
    key = struct.pack("<Q", 2**62) + b"k" * 16
    refused(write(tmp_path / "k.gguf", gguf_bytes([key])), "a metadata key is 4611686018427387904 bytes long")


def test_arrays_are_bounded_in_length_and_depth(tmp_path: Path) -> None:
    long = gguf_string("a") + struct.pack("<IIQ", GGUF_ARRAY, GGUF_U32, 2**62)
    refused(write(tmp_path / "l.gguf", gguf_bytes([long])), "the length of array 'a'")
    level = struct.pack("<IQ", GGUF_ARRAY, 1)  # an array of one array
    nested = gguf_string("n") + struct.pack("<I", GGUF_ARRAY) + level * 2 + struct.pack("<IQI", GGUF_U32, 1, 7)
    refused(write(tmp_path / "n.gguf", gguf_bytes([nested])), "nests arrays deeper than 2")
    many = gguf_string("m") + struct.pack("<IIQ", GGUF_ARRAY, 0, MAX_ELEMENTS + 1) + b"\0" * (MAX_ELEMENTS + 1)
    refused(write(tmp_path / "m.gguf", gguf_bytes([many])), "more than the 2097152 allowed")


def test_tensors_past_the_end_or_of_unknown_type_are_refused(tmp_path: Path) -> None:
    data = bytearray(gguf_bytes())
    offset_at = data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8 + 4
    data[offset_at:offset_at + 8] = struct.pack("<Q", 2**40)
    refused(write(tmp_path / "o.gguf", bytes(data)), "ends past the file")
    huge = gguf_bytes(tensors={"token_embd.weight": (2**40, 2**40)}, data_len=64)
    refused(write(tmp_path / "h.gguf", huge), "larger than the file")


def test_a_50_mb_metadata_string_is_refused_fast_in_bounded_memory(tmp_path: Path) -> None:
    """The issue's case: 109.5 s and a 2.5 GB peak in transformers before; a refusal by the header walk now."""
    path = write(tmp_path / "big.gguf", gguf_bytes([gguf_kv_string("general.architecture", "llama"),
                                                    gguf_kv_string("general.name", b"x" * BIG)]))
    rss = psutil.Process().memory_info().rss
    tracemalloc.start()
    start = time.monotonic()
    with pytest.raises(InvalidModelFile, match=f"52428800 bytes long, more than the {MAX_STRING} allowed"):
        import_gguf(path, tmp_path / "models")
    elapsed = time.monotonic() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 2.0
    assert peak < 1 << 20, f"{peak} bytes allocated"
    assert psutil.Process().memory_info().rss - rss < 32 << 20
    assert not any((tmp_path / "models").glob("*"))  # refused before a model directory was staged


def test_the_import_child_answers_a_hostile_file_with_a_typed_400(tmp_path: Path) -> None:
    path = write(tmp_path / "big.gguf", gguf_bytes([gguf_kv_string("general.name", b"x" * BIG)]))
    start = time.monotonic()
    with pytest.raises(ApiError) as caught:
        asyncio.run(import_in_child(str(path), tmp_path / "models", None))
    assert caught.value.code == ErrorCode.invalid_model_file and caught.value.status == 400
    assert "more than the 1048576 allowed" in caught.value.message
    assert time.monotonic() - start < 20


def test_the_import_child_is_stopped_at_its_memory_budget(tmp_path: Path) -> None:
    """A file that passes the header walk but would need too much memory: the child is killed, a 400 named."""
    path = write(tmp_path / "ok.gguf", gguf_bytes())
    with pytest.raises(ApiError) as caught:
        asyncio.run(import_in_child(str(path), tmp_path / "models", None, memory_budget=40 << 20))
    assert caught.value.code == ErrorCode.invalid_model_file
    assert "needed more than 40 MiB" in caught.value.message


def test_safetensors_header_length_and_offsets_are_checked(tmp_path: Path) -> None:
    assert set(safetensors_header(write(tmp_path / "ok.safetensors", safetensors_bytes()))) == {"__metadata__", "a",
                                                                                                "b"}
    cases = {
        "header length": safetensors_bytes(header_len=2**63),
        "not valid JSON": safetensors_bytes(header_len=10),
        "outside the": safetensors_bytes(extra={"c": {"dtype": "F32", "shape": [1], "data_offsets": [32, 2**40]}}),
        "needs 8 bytes": safetensors_bytes(extra={"c": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}),
        "dtype 'Q9'": safetensors_bytes(extra={"c": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}),
        "shape": safetensors_bytes(extra={"c": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}),
        "must be a JSON object": struct.pack("<Q", 2) + b"[]",
        "the file holds 64": safetensors_bytes(data_len=64),
        "too short": b"\x01\x02",
    }
    for match, data in cases.items():
        with pytest.raises(InvalidModelFile, match=match):
            safetensors_header(write(tmp_path / "bad.safetensors", data))


def test_config_json_must_be_a_bounded_object_of_whole_numbers(tmp_path: Path) -> None:
    assert read_config(write(tmp_path / "config.json", config_bytes())) == CONFIG
    for raw, match in [(b"[1, 2]", "must be a JSON object, not list"), (b'"x"', "not str"),
                       (b"{", "not valid JSON"), (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
                       (b'{"vocab_size": 1' + b"0" * 5000 + b"}", "not valid JSON"),
                       (config_bytes(num_hidden_layers="12"), 'num_hidden_layers is "12"'),
                       (config_bytes(hidden_size=1e300), r"hidden_size is 1e\+300"),
                       (config_bytes(vocab_size=True), "vocab_size is true"),
                       (config_bytes(num_attention_heads=2**40), "from 0 to 4096"),
                       (config_bytes(text_config={"num_hidden_layers": -1}), "text_config.num_hidden_layers"),
                       (config_bytes(text_config=[]), "text_config must be an object")]:
        with pytest.raises(InvalidModelFile, match=match):
            parse_config(raw)
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(MAX_CONFIG + 1)
    with pytest.raises(InvalidModelFile, match="more than the 16777216 allowed"):
        read_config(big)
    with pytest.raises(InvalidModelFile, match="has no num_hidden_layers"):
        card_from_config("org/m", {k: v for k, v in CONFIG.items() if k != "num_hidden_layers"}, 1)


# --- the seeded fuzzers: a few thousand mutations, only InvalidModelFile (or a file the real readers read) ---


def _fuzz_seeds() -> dict[str, bytes]:
    return {"gguf": gguf_bytes([gguf_kv_string("general.architecture", "llama"), gguf_kv_u32("general.alignment", 32),
                                gguf_kv_u32("llama.attention.head_count", 2),
                                gguf_kv_strings("tokenizer.ggml.tokens", ["a", "bc", "def"])]),
            "safetensors": safetensors_bytes(), "config": config_bytes()}


def test_mutated_gguf_files_give_only_the_typed_error(tmp_path: Path) -> None:
    rng, seed, path = random.Random(38), _fuzz_seeds()["gguf"], tmp_path / "f.gguf"
    passed = 0
    for _ in range(2000):
        write(path, mutate(seed, rng))
        try:
            read_layout(path)  # the walk, then the gguf package on what it let through
        except InvalidModelFile:
            continue
        passed += 1
        assert len(GGUFReader(path).tensors) >= 0
    assert 0 < passed < 2000  # the fuzzer reaches both sides


def test_mutated_safetensors_files_give_only_the_typed_error(tmp_path: Path) -> None:
    rng, seed, path = random.Random(39), _fuzz_seeds()["safetensors"], tmp_path / "f.safetensors"
    passed = 0
    for _ in range(1000):
        write(path, mutate(seed, rng))
        try:
            header = safetensors_header(path)
        except InvalidModelFile:
            continue
        passed += 1
        with safe_open(str(path), framework="pt") as f:  # what the walk lets through, the library reads
            for name in header.keys() - {"__metadata__"}:
                f.get_tensor(name)
    assert passed > 0


def test_mutated_config_files_give_only_the_typed_error() -> None:
    rng, seed = random.Random(40), _fuzz_seeds()["config"]
    for _ in range(1500):
        try:
            card_from_config("org/model", parse_config(mutate(seed, rng)), 1)
        except (InvalidModelFile, UnsupportedArchitecture):
            continue

"""Builders of small well-formed GGUF, safetensors and config.json files, and of the hostile variants an attacker
would hand a node (truncated, absurd counts and lengths, offsets past the end), written byte by byte so any field
can lie. Shared by the unit fuzzers (tests/unit/test_hostile_files.py) and the node test
(tests/integration/test_hostile_files_node.py)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

GGUF_STRING, GGUF_ARRAY, GGUF_U32, GGUF_F32 = 8, 9, 4, 6
F32_TYPE = 0
"""GGML type 0: F32, one value per block of one."""


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv_string(key: str, value: str | bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", GGUF_STRING) + gguf_string(value)


def gguf_kv_u32(key: str, value: int) -> bytes:
    return gguf_string(key) + struct.pack("<II", GGUF_U32, value)


def gguf_kv_strings(key: str, values: list[str]) -> bytes:
    body = b"".join(gguf_string(v) for v in values)
    return gguf_string(key) + struct.pack("<IIQ", GGUF_ARRAY, GGUF_STRING, len(values)) + body


def gguf_bytes(kvs: list[bytes] | None = None, tensors: dict[str, tuple[int, ...]] | None = None,
               *, tensor_count: int | None = None, kv_count: int | None = None, alignment: int = 32,
               data_len: int | None = None) -> bytes:
    """A GGUF v3 file of F32 tensors (shape in GGUF's order, innermost first), each aligned; counts may lie."""
    kvs = kvs if kvs is not None else [gguf_kv_string("general.architecture", "llama"),
                                       gguf_kv_u32("llama.attention.head_count", 2)]
    tensors = tensors if tensors is not None else {"token_embd.weight": (8, 4), "output_norm.weight": (8,)}
    infos, offset = b"", 0
    for name, shape in tensors.items():
        infos += gguf_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        infos += struct.pack("<IQ", F32_TYPE, offset)
        size = 4 * _prod(shape)
        offset += -(-size // alignment) * alignment
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if tensor_count is None else tensor_count,
                                 len(kvs) if kv_count is None else kv_count)
    head += b"".join(kvs) + infos
    head += b"\0" * (-len(head) % alignment)
    return head + b"\x01" * (offset if data_len is None else data_len)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]] | None = None, *, header_len: int | None = None,
                      extra: dict[str, object] | None = None, data_len: int | None = None) -> bytes:
    """A safetensors file of the given (dtype, shape) tensors, laid end to end; any field may be overridden."""
    tensors = tensors if tensors is not None else {"a": ("F32", [2, 3]), "b": ("BF16", [4])}
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = sizes[dtype] * _prod(tuple(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header.update(extra or {})
    raw = json.dumps(header).encode()
    length = len(raw) if header_len is None else header_len
    return struct.pack("<Q", length) + raw + b"\0" * (offset if data_len is None else data_len)


CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
          "max_position_embeddings": 512, "torch_dtype": "bfloat16"}


def config_bytes(**changes: object) -> bytes:
    return json.dumps({**CONFIG, **changes}).encode()


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation: flipped bytes, a field overwritten with an extreme integer, a cut, or a splice."""
    out = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif kind == 1:
        at = rng.randrange(max(1, len(out) - 8))
        value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1, rng.randrange(2**64)])
        out[at:at + 8] = struct.pack("<Q", value)
    elif kind == 2:
        del out[rng.randrange(len(out)):]
    elif kind == 3:
        at = rng.randrange(len(out))
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        at = rng.randrange(len(out))
        out[at:at + 4] = struct.pack("<I", rng.choice([0, 1, 4, 8, 9, 13, 2**31, 2**32 - 1]))
    return bytes(out)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path

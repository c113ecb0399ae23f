"""Staged files are checked against the store's SHA-256 (issue 27): a copy that does not match is removed and
staging fails, and the next attempt stages it again."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from skulk.store import client
from skulk.store.files import COMPLETE_MARKER, HASHES_FILE
from skulk.store.server import StoreServer


def test_a_staged_copy_that_does_not_match_the_store_is_removed_and_staged_again(tmp_path: Path) -> None:
    model = tmp_path / "store" / "org--m"
    model.mkdir(parents=True)
    payload = bytes(range(256)) * 4_000
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(payload)
    server = StoreServer(tmp_path / "store", "127.0.0.1", 0).start()
    try:
        base = client.store_url("127.0.0.1", server.server_address[1])
        files, sha256 = client.store_listing(base, "org/m")
        assert sha256["model.safetensors"] == hashlib.sha256(payload).hexdigest()
        assert (model / HASHES_FILE).is_file(), "the store hashes a model once and keeps it"
        target = tmp_path / "staged"
        client.stage(base, "org/m", files, target, None, sha256)
        (target / "model.safetensors").write_bytes(b"\0" * len(payload))  # same size, other bytes
        (target / COMPLETE_MARKER).unlink()
        with pytest.raises(client.CorruptCopy, match=r"model\.safetensors"):
            client.stage(base, "org/m", files, target, None, sha256)
        assert not (target / "model.safetensors").exists() and not (target / COMPLETE_MARKER).exists()
        client.stage(base, "org/m", files, target, None, sha256)
        assert (target / "model.safetensors").read_bytes() == payload
    finally:
        server.close()


def test_the_store_binds_the_address_peers_dial_when_it_is_ours() -> None:
    from skulk.store.server import bind_address

    assert bind_address("0.0.0.0", "10.0.0.5", {"127.0.0.1", "10.0.0.5"}) == "10.0.0.5"
    assert bind_address("0.0.0.0", "studio", {"127.0.0.1", "10.0.0.5"}) == "0.0.0.0"
    assert bind_address("127.0.0.1", None, {"127.0.0.1"}) == "127.0.0.1"

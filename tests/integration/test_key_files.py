"""Secrets off the command line (issue 38): two nodes started with the cluster, API and admin keys in 0600 files
(--cluster-key-file, --api-key-file, --admin-key-file) form one sealed cluster and serve a chat; no process on the
machine (nodes, runners) shows any key in its command line, and the keys work: 401 without, 200 with."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from skulk.cluster.seal import generate_key

from .harness import Cluster, place_and_wait

pytestmark = pytest.mark.timeout(240)
CLUSTER_KEY = generate_key()
API_KEY = f"api-{uuid.uuid4().hex}"
ADMIN_KEY = f"admin-{uuid.uuid4().hex}"


def _key_file(path: Path, text: str) -> str:
    path.write_text(f"# a comment line\n{text}\n")
    path.chmod(0o600)
    return str(path)


def _cmdlines() -> list[str]:
    lines = []
    for proc in psutil.process_iter(["cmdline"]):
        lines.append(" ".join(proc.info["cmdline"] or []))
    return lines


def test_keys_from_files_work_and_no_command_line_shows_them(tmp_path: Path) -> None:
    flags = ["--cluster-key-file", _key_file(tmp_path / "cluster.key", CLUSTER_KEY),
             "--api-key-file", _key_file(tmp_path / "api.keys", API_KEY),
             "--admin-key-file", _key_file(tmp_path / "admin.keys", ADMIN_KEY)]
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    cluster = Cluster(tmp_path)
    try:
        nodes = cluster.form(2, headers=admin, extra_args=flags)  # formed: both sealed with the file's key
        place_and_wait(nodes[0])
        pids = {n.process.pid for n in nodes if n.process is not None}
        runners = [c for pid in pids for c in psutil.Process(pid).children(recursive=True)]
        assert runners, "a runner process was started"
        leaked = [line for line in _cmdlines() if any(k in line for k in (CLUSTER_KEY, API_KEY, ADMIN_KEY))]
        assert leaked == []
        assert any("--cluster-key-file" in line for line in _cmdlines())
        body = {"model": "skulk/tiny-random-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = nodes[1].url + "/v1/chat/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        chat = httpx.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
        assert chat.status_code == 200, chat.text
        config = httpx.get(nodes[1].url + "/config", headers=admin, timeout=10)
        effective = config.json()["effective"]
        assert effective["has_cluster_key"] is True and effective["api_key_count"] == effective["admin_key_count"] == 1
        assert httpx.get(nodes[1].url + "/config", timeout=10).status_code == 401
    finally:
        assert cluster.stop_all() == []


def test_a_readable_key_file_is_read_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from skulk.config import ConfigError, resolve

    shared = tmp_path / "api.keys"
    shared.write_text("k1\nk2\n")
    shared.chmod(0o644)
    settings = resolve({"api_key_file": str(shared), "api_keys": ["k0"], "home": str(tmp_path)}, environ={})
    assert settings.api_keys == ["k0", "k1", "k2"] and "readable by other users" in caplog.text
    env = {"SKULK_CLUSTER_KEY_FILE": _key_file(tmp_path / "c.key", CLUSTER_KEY)}
    assert resolve({"home": str(tmp_path)}, environ=env).cluster_key == CLUSTER_KEY
    with pytest.raises(ConfigError, match="not both"):
        resolve({"cluster_key": "x", "home": str(tmp_path)}, environ=env)
    with pytest.raises(ConfigError, match="cannot read the key file"):
        resolve({"admin_key_file": str(tmp_path / "missing"), "home": str(tmp_path)}, environ={})
    assert os.stat(tmp_path / "c.key").st_mode & 0o077 == 0

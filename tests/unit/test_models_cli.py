"""`skulk models`: --url and --home before or after the command, and `add` answers in words, not a dict."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from skulk.models import cli

ENTRY = {"id": "org/tiny", "description": "llama · 4 layers · 0.01 GB", "context_length": 4096, "downloaded": False}


def test_url_and_home_go_before_or_after_the_command() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["add", "--url", "http://a:1", "org/x"]).url == "http://a:1"
    assert parse(["--url", "http://b:2", "add", "org/x"]).url == "http://b:2"
    assert parse(["add", "org/x"]).url == cli.DEFAULT_URL
    assert parse(["list", "--home", "/tmp/h"]).home == "/tmp/h"
    assert parse(["--home", "/tmp/h", "download", "org/x"]).home == "/tmp/h"


def test_add_prints_what_was_added_in_words(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sent: list[str] = []

    def post(url: str, **_: Any) -> httpx.Response:
        sent.append(url)
        return httpx.Response(200, json=ENTRY)

    monkeypatch.setattr(cli.httpx, "post", post)
    cli.main(["add", "--url", "http://node:9", "org/tiny"])
    out = " ".join(capsys.readouterr().err.split())
    assert sent == ["http://node:9/models/add"]
    assert "added org/tiny: llama · 4 layers · 0.01 GB, context 4096" in out
    assert "not downloaded yet: `skulk models download org/tiny`" in out
    assert "{" not in out and "'id'" not in out


def test_home_points_at_that_homes_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "skulk.yaml").write_text("api_port: 52499\n")
    sent: list[str] = []
    monkeypatch.setattr(cli.httpx, "post", lambda url, **_: sent.append(url) or httpx.Response(200, json=ENTRY))
    cli.main(["add", "--home", str(tmp_path), "org/tiny"])
    assert sent == ["http://localhost:52499/models/add"]


def test_home_of_a_tls_node_is_read_over_https_verified_against_its_own_cert(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from skulk.tls import write_pair

    cert, key = write_pair(tmp_path / "tls", [])
    (tmp_path / "skulk.yaml").write_text(f"api_port: 52498\ntls_cert: {cert}\ntls_key: {key}\n")
    sent: list[tuple[str, object]] = []
    monkeypatch.setattr(cli.httpx, "post", lambda url, **kw: sent.append((url, kw["verify"])) or httpx.Response(
        200, json=ENTRY))
    cli.main(["add", "--home", str(tmp_path), "org/tiny"])
    ((url, verify),) = sent
    assert url == "https://localhost:52498/models/add" and isinstance(verify, ssl.SSLContext)
    assert cli.verify_of(None) is True


def test_a_failed_handshake_is_told_apart_from_no_node(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(url: str, **_: Any) -> httpx.Response:
        try:
            raise ssl.SSLCertVerificationError("certificate verify failed")
        except ssl.SSLError as exc:
            raise httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED]") from exc

    monkeypatch.setattr(cli.httpx, "post", refuse)
    with pytest.raises(SystemExit):
        cli.main(["download", "--url", "https://node:9", "org/tiny"])  # not a download on this machine instead
    assert "TLS handshake" in capsys.readouterr().err

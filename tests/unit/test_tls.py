"""TLS files and settings: `skulk tls self-signed` writes a pair that cryptography and ssl load, naming the given
hosts and localhost, its key private; a node refuses at start a certificate without its key, an unreadable file
or a key that is not the certificate's; peers are dialled with the scheme the node serves."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import stat
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from skulk import peer_tls
from skulk.announce import try_line
from skulk.cli import main as cli_main
from skulk.config import ConfigError, Settings, resolve
from skulk.store import client
from skulk.store.fetch import partial_path
from skulk.store.server import StoreServer
from skulk.tls import server_context, write_pair

pytestmark = pytest.mark.timeout(30)


def _sans(cert_path: Path) -> tuple[list[str], list[str]]:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return names.get_values_for_type(x509.DNSName), [str(a) for a in names.get_values_for_type(x509.IPAddress)]


def test_skulk_tls_self_signed_writes_a_pair_for_the_given_hosts(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    cli_main(["tls", "self-signed", "--out", str(out), "--host", "node-a.lan", "--host", "192.168.1.20"])
    cert_path, key_path = out / "cert.pem", out / "key.pem"
    dns, ips = _sans(cert_path)
    assert {"node-a.lan", "localhost"} <= set(dns)
    assert {"192.168.1.20", "127.0.0.1", "::1"} <= set(ips)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(days=360) < left <= datetime.timedelta(days=366)
    ssl.create_default_context().load_cert_chain(cert_path, key_path)  # the pair matches, as uvicorn loads it


def test_a_client_trusting_the_cert_completes_a_handshake_with_it(tmp_path: Path) -> None:
    cert_path, key_path = write_pair(tmp_path, [])
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert_path, key_path)

    async def handshake() -> bool:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_side)
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=peer_tls.client_context(cert_path, None)), 10)
            writer.close()
            _, writer = await asyncio.wait_for(asyncio.open_connection(
                "localhost", port, ssl=peer_tls.client_context(cert_path, cert_path)), 10)
            writer.close()
            return True
        finally:
            server.close()

    assert asyncio.run(handshake())


def _flags(**given: object) -> dict[str, object]:
    return {"config": "/nonexistent/skulk.yaml", **given}


def test_a_cert_without_its_key_or_a_ca_without_tls_stops_the_node(tmp_path: Path) -> None:
    cert_path, key_path = write_pair(tmp_path, [])
    for given in ({"tls_cert": str(cert_path)}, {"tls_key": str(key_path)}, {"tls_ca": str(cert_path)}):
        with pytest.raises(ConfigError, match="tls"):
            resolve(_flags(**given), environ={})


def test_unreadable_or_mismatched_files_stop_the_node_with_the_file_named(tmp_path: Path) -> None:
    cert_path, key_path = write_pair(tmp_path / "a", [])
    other_cert, other_key = write_pair(tmp_path / "b", [])
    with pytest.raises(ConfigError, match="does not match"):
        resolve(_flags(tls_cert=str(cert_path), tls_key=str(other_key)), environ={})
    with pytest.raises(ConfigError, match=r"cannot read .*missing\.pem"):
        resolve(_flags(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(key_path)), environ={})
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        resolve(_flags(tls_cert=str(key_path), tls_key=str(key_path)), environ={})
    with pytest.raises(ConfigError, match="CA file"):
        resolve(_flags(tls_cert=str(cert_path), tls_key=str(key_path), tls_ca=str(key_path)), environ={})
    assert resolve(_flags(tls_cert=str(other_cert), tls_key=str(other_key)), environ={}).serves_tls


def test_the_environment_and_the_config_file_give_the_pair_too(tmp_path: Path) -> None:
    cert_path, key_path = write_pair(tmp_path, [])
    from_env = resolve(_flags(), environ={"SKULK_TLS_CERT": str(cert_path), "SKULK_TLS_KEY": str(key_path)})
    assert (from_env.tls_cert, from_env.tls_key, from_env.tls_ca) == (cert_path, key_path, None)
    config = tmp_path / "skulk.yaml"
    config.write_text(f"tls_cert: {cert_path}\n")  # the key from the environment: checked once resolved
    split = resolve({"config": str(config)}, environ={"SKULK_TLS_KEY": str(key_path)})
    assert split.tls_cert == cert_path and split.tls_key == key_path
    assert not resolve(_flags(), environ={}).serves_tls  # plain http is the default


def test_peers_are_dialled_with_the_scheme_the_node_serves(tmp_path: Path) -> None:
    cert_path, _ = write_pair(tmp_path, [])
    try:
        peer_tls.configure(cert_path, None)
        assert peer_tls.base_url("10.0.0.2", 52415) == "https://10.0.0.2:52415"
        assert peer_tls.base_url("fe80::1", 1) == "https://[fe80::1]:1" == peer_tls.base_url("[fe80::1]", 1)
        assert isinstance(peer_tls.verify(), ssl.SSLContext)
    finally:
        peer_tls.configure(None, None)
    assert peer_tls.base_url("10.0.0.2", 52415) == "http://10.0.0.2:52415" and peer_tls.verify() is True


def test_the_start_up_curl_line_uses_https_and_the_cert(tmp_path: Path) -> None:
    cert_path, key_path = write_pair(tmp_path, [])
    line = try_line(Settings(tls_cert=cert_path, tls_key=key_path), 52415)
    assert f"curl https://localhost:52415/v1/chat/completions --cacert {cert_path}" in line
    assert "dashboard at https://localhost:1/" in try_line(Settings(tls_cert=cert_path, tls_key=key_path,
                                                                     place_default=False), 1)


def test_the_model_store_stages_over_https_and_refuses_plain_http(tmp_path: Path) -> None:
    """A node serving TLS serves its store over https too; a stager resumes a partial through it (no splice:
    the bytes on the socket are ciphertext) and gets the store's bytes; plain http to the port gets nothing."""
    cert_path, key_path = write_pair(tmp_path / "tls", [])
    model = tmp_path / "store" / "org--m"
    model.mkdir(parents=True)
    payload = bytes(range(256)) * 8_000
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(payload)
    server = StoreServer(tmp_path / "store", "127.0.0.1", 0, tls=server_context(cert_path, key_path)).start()
    port = server.server_address[1]
    try:
        peer_tls.configure(cert_path, None)
        base = client.store_url("127.0.0.1", port)
        assert base.startswith("https://")
        files = client.store_files(base, "org/m")
        target = tmp_path / "staged"
        part = partial_path(target / "model.safetensors")
        part.parent.mkdir(parents=True)
        part.write_bytes(payload[:123_457])
        client.stage(base, "org/m", files, target, lambda _done, _files: None)
        assert (target / "model.safetensors").read_bytes() == payload
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/registry", timeout=5, trust_env=False)
    finally:
        peer_tls.configure(None, None)
        server.close()



def test_keys_over_plain_http_beyond_loopback_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from skulk.node import _harden

    cert_path, key_path = write_pair(tmp_path, [])
    key = "sk-tls-warning-test-0123456789"
    cases = [(Settings(api_keys=[key]), True), (Settings(api_keys=[key], tls_cert=cert_path, tls_key=key_path), False),
             (Settings(api_keys=[key], api_host="127.0.0.1"), False), (Settings(), False)]
    for settings, warned in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="skulk.node"):
            _harden(settings)
        assert any("clear text" in r.getMessage() for r in caplog.records) == warned, settings


def test_skulk_with_a_cert_and_no_key_exits_2_naming_both_flags(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    cert_path, _ = write_pair(tmp_path, [])
    with pytest.raises(SystemExit) as exited:
        cli_main(["--config", str(tmp_path / "none.yaml"), "--tls-cert", str(cert_path)])
    assert exited.value.code == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err

"""skulk.yaml: nested sections, strict validation with messages that name file and key, env twins."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.config import ConfigError, Settings, resolve

pytestmark = pytest.mark.timeout(10)


def _resolve(tmp_path: Path, text: str, env: dict[str, str] | None = None, **flags: object) -> Settings:
    path = tmp_path / "skulk.yaml"
    path.write_text(text)
    return resolve({"config": str(path), "home": str(tmp_path), **flags}, env or {})


def test_runbook_layout_is_read(tmp_path: Path) -> None:
    settings = _resolve(
        tmp_path,
        """
model_store:
  enabled: true
  store_host: studio
  store_path: /srv/store
  download: {allow_hf_fallback: false}
  staging: {cleanup_on_deactivate: true, staging_keep_recent_gb: 5}
  node_overrides:
    studio: {staging: {cleanup_on_deactivate: false}}
hf_token: hf_abc
logging: {enabled: false}
tracing: {retention_days: 7}
""",
        node_name="studio",
    )
    assert settings.is_store_host
    assert settings.store_path == Path("/srv/store")
    assert not settings.model_store.download.allow_hf_fallback
    assert settings.hf_token == "hf_abc"
    assert settings.tracing.retention_days == 7
    staging = settings.staging_for("some-node-id")
    assert (staging.cleanup_on_deactivate, staging.staging_keep_recent_gb) == (False, 5)
    assert staging.node_cache_path == tmp_path.resolve() / "staging"


def test_defaults_are_the_runbooks(tmp_path: Path) -> None:
    settings = _resolve(tmp_path, "")
    staging = settings.staging_for("x")
    assert (staging.cleanup_on_deactivate, staging.staging_keep_recent_gb) == (True, 40.0)
    assert settings.model_store.store_port == 58080
    assert settings.model_store.download.allow_hf_fallback
    assert not settings.is_store_host


def test_override_by_node_id_wins_over_hostname(tmp_path: Path) -> None:
    settings = _resolve(
        tmp_path,
        "model_store:\n  node_overrides:\n    nid1: {staging: {staging_keep_recent_gb: 1}}\n"
        "    box: {staging: {staging_keep_recent_gb: 2}}\n",
        node_name="box",
    )
    assert settings.staging_for("nid1").staging_keep_recent_gb == 1
    assert settings.staging_for("other").staging_keep_recent_gb == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "model_store:\n  staging:\n    staging_keep_recnt_gb: 3\n",
            "model_store.staging.staging_keep_recnt_gb: unknown key; allowed here: cleanup_on_deactivate",
        ),
        ("model_store:\n  store_port: abc\n", "model_store.store_port: Input should be a valid integer"),
        ("apiport: 1\n", "apiport: unknown key; allowed here: admin_keys, allowed_hosts, api_host"),
        (
            "model_store:\n  node_overrides:\n    b:\n      staging: {bogus: 1}\n",
            "node_overrides.b.staging.bogus: unknown key",
        ),
        ("[1, 2]\n", "expected a mapping"),
    ],
)
def test_invalid_file_names_file_key_and_allowed(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _resolve(tmp_path, text)
    assert expected in str(caught.value)
    if "mapping" not in expected:
        assert str(tmp_path / "skulk.yaml") in str(caught.value)


def test_env_twins_and_precedence(tmp_path: Path) -> None:
    env = {
        "SKULK_API_PORT": "9000",
        "SKULK_STAGING_KEEP_RECENT_GB": "0",
        "HF_TOKEN": "from-hf",
        "HF_ENDPOINT": "http://127.0.0.1:1",
        "SKULK_BOOTSTRAP_PEERS": "tcp/a:1, tcp/b:2",
    }
    settings = _resolve(tmp_path, "api_port: 8000\nmodel_store: {store_port: 1234}\n", env, api_port=7000)
    assert settings.api_port == 7000
    assert settings.model_store.store_port == 1234  # the file's other keys of the section survive
    assert settings.staging_for("x").staging_keep_recent_gb == 0
    assert settings.hf_token == "from-hf"
    assert settings.model_store.download.hf_endpoint == "http://127.0.0.1:1"
    assert settings.bootstrap_peers == ["tcp/a:1", "tcp/b:2"]
    env["SKULK_HF_TOKEN"] = "from-skulk"
    assert _resolve(tmp_path, "", env).hf_token == "from-skulk"


def test_top_level_sections_are_read_as_model_store_ones(tmp_path: Path) -> None:
    settings = _resolve(tmp_path, "staging: {staging_keep_recent_gb: 3}\ndownload: {allow_hf_fallback: false}\n")
    assert settings.staging_for("x").staging_keep_recent_gb == 3
    with pytest.raises(ConfigError, match="both"):
        _resolve(tmp_path, "staging: {}\nmodel_store: {staging: {}}\n")

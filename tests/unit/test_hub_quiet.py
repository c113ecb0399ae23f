"""The hub client makes no side request: building headers never fetches huggingface_hub's agent registry
(`/api/agent-harnesses`, a logged 404 on a mirror)."""

from __future__ import annotations

import pytest


def test_headers_never_fetch_the_agent_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub.utils import _detect_agent

    import skulk.store.hub  # noqa: F401  (its import settles the hub client's settings)
    from skulk.store.hub import build_hf_headers

    fetched: list[bool] = []

    def fetch() -> None:
        fetched.append(True)  # huggingface_hub swallows errors here: record the call instead

    monkeypatch.setattr(_detect_agent, "_registry", None)
    monkeypatch.setattr(_detect_agent, "_read_cached_registry", lambda *_a, **_k: None)
    monkeypatch.setattr(_detect_agent, "_fetch_registry", fetch)
    headers = build_hf_headers(token=False)
    assert "hf_hub/" in headers["user-agent"]
    assert fetched == [], "building headers fetched the agent registry"

"""A Responses conversation behind a load balancer (issue 46): created on one node, it is retrieved, continued
and deleted through another, with the official openai client, in both directions; another inference key gets
the same 404 on every node, and a deleted response is gone everywhere. The nodes ask each other on signed
internal calls (a cluster key and API keys are on, as a LAN deployment would run)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from skulk.cluster.seal import generate_key
from skulk.testing.cluster import DEMO

from .harness import Cluster, place_and_wait

pytestmark = pytest.mark.timeout(180)
ADMIN, ALICE, BOB = "admin-key-of-the-test", "alice-key", "bob-key"


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_a_response_is_found_from_any_node(cluster: Cluster) -> None:
    env = {"SKULK_CLUSTER_KEY": generate_key(), "SKULK_ADMIN_KEYS": ADMIN, "SKULK_API_KEYS": f"{ALICE},{BOB}"}
    a, b = cluster.form(2, extra_env=env, headers={"Authorization": f"Bearer {ADMIN}"})
    place_and_wait(a, DEMO)
    alice_a, alice_b = _client(a.url, ALICE), _client(b.url, ALICE)

    first = alice_a.responses.create(model=DEMO, input="hello", max_output_tokens=4)
    assert alice_b.responses.retrieve(first.id).id == first.id, "B reads what A answered"
    second = alice_b.responses.create(model=DEMO, input="and then?", previous_response_id=first.id,
                                      max_output_tokens=4)
    assert second.previous_response_id == first.id
    streamed = list(alice_a.responses.create(model=DEMO, input="more", previous_response_id=second.id,
                                             max_output_tokens=4, stream=True))
    last: Any = streamed[-1]
    assert last.type in ("response.completed", "response.incomplete"), "A continues what B answered, streamed"
    assert last.response.previous_response_id == second.id

    for node in (a, b):
        with pytest.raises(openai.NotFoundError):
            _client(node.url, BOB).responses.retrieve(first.id)
    assert _client(b.url, ADMIN).responses.retrieve(second.id).id == second.id

    alice_b.responses.delete(first.id)
    for client in (alice_a, alice_b):
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.retrieve(first.id)
        assert "any node" in str(gone.value)
    with pytest.raises(openai.NotFoundError):
        alice_a.responses.create(model=DEMO, input="x", previous_response_id=first.id, max_output_tokens=2)

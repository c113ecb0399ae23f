"""A card that names a draft model (ModelCard.draft_model) through a real node: the target's and the draft's
checkpoints (random weights, the byte tokenizer) are in the node's store, the cards in its custom cards folder. The
runner builds the engine with the draft, the chat answers are plain greedy decoding's (computed here in-process
without speculation), and the runner logs the acceptance in the runbook's words."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.models.catalog import card_from_config
from skulk.models.demo import generate_random_llama
from skulk.store.files import model_dir_name

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(180)

TARGET, DRAFT = "org/tiny-target", "org/tiny-draft"
QUESTIONS = ["Repeat after me: the quick brown fox jumps over the lazy dog.", "hi"]


def _checkpoints(home: Path) -> Path:
    """Both checkpoints in the node's store (a hand-copied directory counts as complete), their cards in its
    custom cards folder; the target's card names the draft. The target's directory, for the plain reference."""
    import json

    store = home / "models"
    target = generate_random_llama(store / model_dir_name(TARGET), hidden_size=64, n_layers=2, n_heads=4,
                                   n_kv_heads=2, intermediate_size=128, seed=3)
    draft = generate_random_llama(store / model_dir_name(DRAFT), hidden_size=32, n_layers=1, n_heads=2,
                                  n_kv_heads=1, intermediate_size=64, seed=4)
    (home / "cards").mkdir(parents=True)
    for model_id, path, extra in ((TARGET, target, {"draft_model": DRAFT}), (DRAFT, draft, {})):
        config = json.loads((path / "config.json").read_text())
        card = card_from_config(model_id, config, (path / "model.safetensors").stat().st_size)
        card = card.model_copy(update=extra)
        (home / "cards" / f"{model_dir_name(model_id)}.json").write_text(card.model_dump_json(by_alias=True))
    return target


def _plain(target: Path, question: str, max_tokens: int) -> str:
    from skulk.engines.torch.engine import TorchEngine
    from skulk.types.chat import ChatMessage, SamplingParams

    engine = TorchEngine(target, max_seq=512, speculate=False)
    engine.add_request("plain", engine.encode_chat([ChatMessage(role="user", content=question)]),
                       SamplingParams(max_tokens=max_tokens, temperature=0))
    text = []
    while engine.has_work():
        text += [out.text for out in engine.step()]
    return "".join(text)


def test_a_card_with_a_draft_model_serves_plain_decoding_and_logs_acceptance(cluster: Cluster) -> None:
    target = _checkpoints(cluster.root / "node0")
    node = cluster.start(1)[0]
    instance_id = place(node, TARGET)["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 90, "the instance to be ready", node.log_tail)
    assert any(f"draft model {DRAFT} drafts for {TARGET}" in line for line in node.output), node.log_tail()
    for question in QUESTIONS:
        code, reply = node.post("/v1/chat/completions", {"model": TARGET, "max_tokens": 40, "temperature": 0,
                                                          "messages": [{"role": "user", "content": question}]})
        assert code == 200, reply
        assert reply["choices"][0]["message"]["content"] == _plain(target, question, 40)
    wait_until(lambda: sum("MTP acceptance" in line and "draft-model" in line for line in node.output) >= 2, 30,
               "the runner to log the acceptance of both chats", node.log_tail)

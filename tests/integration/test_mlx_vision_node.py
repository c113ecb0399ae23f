"""An image through a real node on the MLX engine: a random Gemma 3 vision-language checkpoint (six layers, the
published sliding pattern mlx-lm reads) placed with engine "mlx". An OpenAI image_url request answers the
in-process MLX engine's greedy text for the same image (whose tokens tests/unit/test_mlx_vision.py holds to
transformers'), a text request still answers, and the runner's flight recorder shows the vision_preprocess phase."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from skulk.models.catalog import card_from_config
from skulk.models.demo import ensure_demo_model
from skulk.store.files import model_dir_name
from skulk.types.chat import ChatMessage, SamplingParams
from tests.unit.test_vision import image_message
from tests.unit.vlm_checkpoint import TOKENS, png, write_gemma3_vlm

from .harness import Cluster, instance_ready, place, wait_until

pytest.importorskip("mlx_lm")

pytestmark = pytest.mark.timeout(240)
VLM = "org/tiny-gemma3-vlm-mlx"
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)


def _checkpoint(home: Path, scratch: Path) -> Path:
    path = write_gemma3_vlm(home / "models", ensure_demo_model(scratch), model_dir_name(VLM), layers=6)
    config = json.loads((path / "config.json").read_text())
    card = card_from_config(VLM, config, (path / "model.safetensors").stat().st_size)
    assert card.vision
    (home / "cards").mkdir(parents=True)
    (home / "cards" / f"{model_dir_name(VLM)}.json").write_text(card.model_dump_json(by_alias=True))
    return path


def _in_process(path: Path, message: ChatMessage) -> str:
    from skulk.engines.mlx.engine import MlxEngine

    engine = MlxEngine(path, max_batch=2)
    if message.images:
        prompt, vision = engine.encode_images([message])
        engine.add_request("here", prompt, GREEDY, vision=vision)
    else:
        engine.add_request("here", engine.encode_chat([message]), GREEDY)
    text = []
    while engine.has_work():
        text += [out.text for out in engine.step()]
    return "".join(text)


def test_an_image_request_through_an_mlx_node(cluster: Cluster, tmp_path: Path) -> None:
    path = _checkpoint(cluster.root / "node0", tmp_path)
    node = cluster.start(1)[0]
    instance_id = place(node, VLM, engine="mlx")["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 120, "the instance to be ready", node.log_tail)
    assert node.get("/state")["instances"][instance_id]["MlxRingInstance"]["engine"] == "mlx"
    picture = base64.b64encode(png(1)).decode()
    code, reply = node.post("/v1/chat/completions", {
        "model": VLM, "max_tokens": TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}},
            {"type": "text", "text": "What is this?"}]}]})
    assert code == 200, reply
    assert reply["choices"][0]["message"]["content"] == _in_process(path, image_message(png(1)))
    code, reply = node.post("/v1/chat/completions", {
        "model": VLM, "max_tokens": TOKENS, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
    assert code == 200, reply
    assert reply["choices"][0]["message"]["content"] == _in_process(path, ChatMessage(role="user", content="Hi"))

    def vision_events() -> list[str]:
        runners = node.get("/v1/diagnostics/node").get("supervisorRunners") or []
        return [e["event"] for r in runners if r["instanceId"] == instance_id for e in r["flightRecorder"]
                if e["phase"] == "vision_preprocess"]

    assert "vision_start" in wait_until(vision_events, 30, "the runner's vision_preprocess phase")

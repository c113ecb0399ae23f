"""An image through a real node: a random Gemma 3 vision-language checkpoint in the node's store, its card (vision
read from its config) in the custom cards folder. An OpenAI image_url request answers the in-process engine's
greedy text for the same image (whose tokens tests/unit/test_vision.py holds to transformers'), an Ollama one the
same; a bad image is a 400 from the live node; the runner's flight recorder shows the vision_preprocess phase."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from skulk.models.catalog import card_from_config
from skulk.models.demo import ensure_demo_model
from skulk.store.files import model_dir_name
from skulk.types.chat import SamplingParams
from tests.unit import qwen_vl_checkpoint
from tests.unit.test_vision import GREEDY, image_message
from tests.unit.vlm_checkpoint import IMAGE_TOKENS, TOKENS, png, write_gemma3_vlm

from .harness import Cluster, instance_ready, place, wait_until

pytestmark = pytest.mark.timeout(240)
VLM = "org/tiny-gemma3-vlm"


def _checkpoint(home: Path, scratch: Path, model: str = VLM, write: Callable[..., Path] = write_gemma3_vlm) -> Path:
    path = write(home / "models", ensure_demo_model(scratch), model_dir_name(model))
    config = json.loads((path / "config.json").read_text())
    card = card_from_config(model, config, (path / "model.safetensors").stat().st_size)
    assert card.vision
    (home / "cards").mkdir(parents=True)
    (home / "cards" / f"{model_dir_name(model)}.json").write_text(card.model_dump_json(by_alias=True))
    return path


def _in_process(path: Path, picture: bytes, sampling: SamplingParams = GREEDY) -> str:
    from skulk.engines.torch.engine import TorchEngine

    engine = TorchEngine(path, max_batch=2)
    prompt, vision = engine.encode_images([image_message(picture)])
    engine.add_request("here", prompt, sampling, vision=vision)
    text = []
    while engine.has_work():
        text += [out.text for out in engine.step()]
    return "".join(text)


def test_an_image_request_through_a_node(cluster: Cluster, tmp_path: Path) -> None:
    path = _checkpoint(cluster.root / "node0", tmp_path)
    node = cluster.start(1)[0]
    instance_id = place(node, VLM)["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 120, "the instance to be ready", node.log_tail)
    picture = base64.b64encode(png(1)).decode()
    expected = _in_process(path, png(1))
    code, reply = node.post("/v1/chat/completions", {
        "model": VLM, "max_tokens": TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}},
            {"type": "text", "text": "What is this?"}]}]})
    assert code == 200, reply
    assert reply["choices"][0]["message"]["content"] == expected
    code, reply = node.post("/ollama/api/chat", {"model": VLM, "stream": False, "options": {
        "temperature": 0, "num_predict": TOKENS}, "messages": [
        {"role": "user", "content": "What is this?", "images": [picture]}]})
    assert code == 200, reply
    assert reply["message"]["content"] == expected
    code, reply = node.post("/v1/chat/completions", {
        "model": VLM, "max_tokens": TOKENS, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]})
    assert code == 400 and "no network fetch" in reply["error"]["message"], reply
    claude = {"model": VLM, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}},
        {"type": "text", "text": "What is this?"}]}]}
    code, answered = node.post("/v1/messages", claude)
    assert code == 200, answered
    code, counted = node.post("/v1/messages/count_tokens", {k: v for k, v in claude.items() if k != "max_tokens"})
    assert code == 200 and counted["input_tokens"] == answered["usage"]["input_tokens"], (counted, answered)
    text_only = {"model": VLM, "messages": [{"role": "user", "content": "What is this?"}]}
    code, plain = node.post("/v1/messages/count_tokens", text_only)
    assert code == 200 and counted["input_tokens"] - plain["input_tokens"] >= IMAGE_TOKENS + 2, (counted, plain)
    tools = [{"name": "look", "description": "Describe a picture", "input_schema": {
        "type": "object", "properties": {"detail": {"type": "string"}}}}]
    code, answered = node.post("/v1/messages", {**claude, "tools": tools})  # the tools overflow its 256 tokens
    assert code == 400 and "prompt has" in answered["error"]["message"], answered
    code, counted = node.post("/v1/messages/count_tokens", {**text_only, "messages": claude["messages"],
                                                            "tools": tools})
    assert (code, counted["error"]["message"]) == (400, answered["error"]["message"]), (counted, answered)
    code, reply = node.post("/ollama/api/show", {"model": VLM})
    assert code == 200 and "vision" in reply["capabilities"], reply

    def vision_events() -> list[str]:
        runners = node.get("/v1/diagnostics/node").get("supervisorRunners") or []
        return [e["event"] for r in runners if r["instanceId"] == instance_id for e in r["flightRecorder"]
                if e["phase"] == "vision_preprocess"]

    assert "vision_start" in wait_until(vision_events, 30, "the runner's vision_preprocess phase")


QWEN_VL = "org/tiny-qwen25-vl"


def test_a_qwen_vl_image_request_through_a_node(cluster: Cluster, tmp_path: Path) -> None:
    """The same for Qwen2.5-VL, whose image expands to its own grid's count of <|image_pad|>: the OpenAI answer is
    the in-process engine's 16 greedy tokens (tests/unit/test_qwen_vl.py holds those to transformers'), the API
    node's count_tokens is the prompt the runner rendered, and an image that cannot be decoded is a 400."""
    tokens = qwen_vl_checkpoint.TOKENS
    path = _checkpoint(cluster.root / "node0", tmp_path, QWEN_VL, qwen_vl_checkpoint.write_qwen25_vl)
    node = cluster.start(1)[0]
    instance_id = place(node, QWEN_VL)["instanceId"]
    wait_until(lambda: instance_ready(node, instance_id), 120, "the instance to be ready", node.log_tail)
    data = qwen_vl_checkpoint.picture(1)
    expected = _in_process(path, data, SamplingParams(max_tokens=tokens, temperature=0))
    picture = base64.b64encode(data).decode()
    code, reply = node.post("/v1/chat/completions", {
        "model": QWEN_VL, "max_tokens": tokens, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}},
            {"type": "text", "text": "What is this?"}]}]})
    assert code == 200, reply
    assert reply["choices"][0]["message"]["content"] == expected
    claude = {"model": QWEN_VL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}},
        {"type": "text", "text": "What is this?"}]}]}
    code, answered = node.post("/v1/messages", claude)
    assert code == 200, answered
    code, counted = node.post("/v1/messages/count_tokens", {k: v for k, v in claude.items() if k != "max_tokens"})
    assert code == 200 and counted["input_tokens"] == answered["usage"]["input_tokens"], (counted, answered)
    broken = base64.b64encode(b"not a picture at all").decode()
    code, reply = node.post("/v1/chat/completions", {
        "model": QWEN_VL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{broken}"}}]}]})
    assert code == 400 and "cannot be decoded" in reply["error"]["message"], reply

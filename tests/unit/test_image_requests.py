"""Images at the API, before any runner is asked: a vision model's bad image is one 400 in each API's own shape
(a network URL, a file:// outside the allowed directory, bytes that are no image, too many pixels); a good one
passes the check (and a file:// one travels on as data); the bounds of formats/images.py."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from skulk.api.app import create_app
from skulk.api.images import checked_images
from skulk.config import Settings
from skulk.formats.images import MAX_IMAGE_PIXELS, ImageRefused, decode_base64, image_bytes, open_image
from skulk.types.chat import ChatCompletionRequest
from skulk.types.errors import ApiError
from skulk.types.ids import ModelId
from skulk.types.state import State

from .factories import CARD, api_services

pytestmark = pytest.mark.timeout(60)
VLM = CARD.model_copy(update={"model_id": ModelId("test/vlm"), "vision": True})


def png(width: int = 8, height: int = 8) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def allowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    (folder / "red.png").write_bytes(png())
    return folder


@pytest.fixture(scope="module")
def client(allowed: Path) -> TestClient:
    state = State(model_cards={CARD.model_id: CARD, VLM.model_id: VLM})
    services = api_services(state=state, settings=Settings(image_dir=allowed))
    return TestClient(create_app(services), base_url="http://127.0.0.1")


def openai(url: str) -> dict[str, Any]:
    return {"model": "test/vlm", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.mark.parametrize(("url", "says"), [
    ("https://example.com/cat.png", "no network fetch"),
    ("data:image/png;base64," + b64(b"no picture here"), "cannot be decoded"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("file:///etc/hostname", "must be under"),
    ("data:image/png;base64," + b64(png(4097, 4097)), f"more than {MAX_IMAGE_PIXELS} pixels"),
])
def test_a_bad_image_is_a_400_in_openais_shape(client: TestClient, url: str, says: str) -> None:
    reply = client.post("/v1/chat/completions", json=openai(url))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and says in error["message"]
    assert "messages.0.content.1" in error["message"]


def test_a_good_image_passes_the_check(client: TestClient, allowed: Path) -> None:
    for url in ("data:image/png;base64," + b64(png()), (allowed / "red.png").as_uri()):
        reply = client.post("/v1/chat/completions", json=openai(url))
        assert reply.status_code == 404, reply.text  # past the images: no instance of the model is placed


def test_a_text_models_image_is_text_only_and_responses_input_image_is_checked(client: TestClient) -> None:
    """A served card without vision answers text_only (as every model did before images were read); Responses'
    input_image reaches the same check as a chat image part."""
    body = openai("data:image/png;base64," + b64(png()))
    reply = client.post("/v1/chat/completions", json={**body, "model": str(CARD.model_id)})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "text_only", reply.text
    bad = client.post("/v1/responses", json={"model": "test/vlm", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": "https://x/y.png"}]}]})
    assert bad.status_code == 400 and "no network fetch" in bad.json()["error"]["message"], bad.text


def test_claude_and_ollama_answer_a_bad_image_in_their_shapes(client: TestClient) -> None:
    bad = b64(b"not an image")
    claude = client.post("/v1/messages", json={"model": "test/vlm", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": bad}}, {"type": "text", "text": "?"}]}]})
    assert claude.status_code == 400 and claude.json()["type"] == "error", claude.text
    assert "cannot be decoded" in claude.json()["error"]["message"]
    url = client.post("/v1/messages", json={"model": "test/vlm", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]})
    assert url.status_code == 400 and "no network fetch" in url.json()["error"]["message"], url.text
    for path, body in (("/ollama/api/chat", {"model": "test/vlm", "messages": [
                           {"role": "user", "content": "what?", "images": [bad]}]}),
                       ("/ollama/api/generate", {"model": "test/vlm", "prompt": "what?", "images": [bad]})):
        reply = client.post(path, json=body)
        assert reply.status_code == 400 and "cannot be decoded" in reply.json()["error"], reply.text


def test_a_file_image_travels_as_data_and_file_urls_are_off_without_a_directory(allowed: Path) -> None:
    request = ChatCompletionRequest.model_validate(openai((allowed / "red.png").as_uri()))
    state = State(model_cards={VLM.model_id: VLM})
    checked = checked_images(api_services(state=state, settings=Settings(image_dir=allowed)), request)
    assert checked.messages[0].images[0].startswith("data:") and open_image(image_bytes(checked.messages[0].images[0]))
    with pytest.raises(ApiError, match="file:// image URLs are off"):
        checked_images(api_services(state=state), request)


def test_the_bounds() -> None:
    with pytest.raises(ImageRefused, match="empty"):
        decode_base64("")
    with pytest.raises(ImageRefused, match="larger than"):
        decode_base64("A" * (30 * 1024 * 1024))
    with pytest.raises(ImageRefused, match="data: URL"):
        image_bytes("ftp://host/x.png")
    assert open_image(png(3, 5)).size == (3, 5)

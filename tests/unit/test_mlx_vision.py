"""Images into a vision-language model on the MLX engine: a random Gemma 3 checkpoint's greedy tokens for an image
prompt (float32, 16 steps) equal transformers' own Gemma3ForConditionalGeneration's, with the tower's embeddings in
mlx-lm's language model and the image's tokens attending both ways (engines/mlx/vision.py); a text prompt on the
same model equals transformers' too; the engine is one the runner hands images to (engines/base.Sees), a text
model refuses them, and the card of such a checkpoint offers images with the MLX engine among its backends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")

from skulk.engines.base import Sees
from skulk.engines.errors import PromptRejected
from skulk.engines.mlx.engine import MlxEngine
from skulk.engines.torch.vision import image_spans
from skulk.models.catalog import card_from_config
from skulk.models.demo import ensure_demo_model
from skulk.types.backends import allows
from skulk.types.chat import ChatMessage, SamplingParams
from tests.unit.test_vision import image_message
from tests.unit.vlm_checkpoint import IMAGE_TOKENS, png, reference, write_gemma3_vlm

STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mlx-vlm")
    demo = ensure_demo_model(root / "models")
    return write_gemma3_vlm(root, demo, layers=6), demo  # mlx-lm reads the published pattern


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> MlxEngine:
    return MlxEngine(models[0], max_batch=4, prefill_chunk=64)


def run(engine: MlxEngine, rid: str, prompt: list[int], vision: object = None) -> list[int]:
    if vision is None:
        engine.add_request(rid, prompt, GREEDY)
    else:
        engine.add_request(rid, prompt, GREEDY, vision=vision)  # type: ignore[arg-type]
    out: list[int] = []
    for _ in range(4 * STEPS):
        if not engine.has_work():
            break
        out += [t.token_id for t in engine.step() if t.request_id == rid]
    return out


@pytest.mark.timeout(300)
def test_greedy_image_tokens_equal_transformers(engine: MlxEngine, models: tuple[Path, Path]) -> None:
    prompt, vision = engine.encode_images([image_message(png(1))])
    assert [e - s for s, e in image_spans(prompt, engine.image_token)] == [IMAGE_TOKENS]
    ours = run(engine, "a", prompt, vision)
    assert len(ours) == STEPS
    assert ours == reference(models[0], prompt, [png(1)], STEPS)
    other_prompt, other_vision = engine.encode_images([image_message(png(2))])
    other = run(engine, "b", other_prompt, other_vision)
    assert other_prompt == prompt and other != ours  # same placeholders, another image: its own answer
    assert other == reference(models[0], prompt, [png(2)], STEPS)


@pytest.mark.timeout(300)
def test_a_text_prompt_on_the_vision_model_equals_transformers(engine: MlxEngine, models: tuple[Path, Path]) -> None:
    prompt = engine.encode_chat([ChatMessage(role="user", content="What is this?")])
    assert run(engine, "t", prompt) == reference(models[0], prompt, [], STEPS)


@pytest.mark.timeout(300)
def test_an_image_chunk_is_never_split_and_prefills_alone(engine: MlxEngine, models: tuple[Path, Path]) -> None:
    """A prefill chunk that would end inside the image stops before it, and an image prompt does not join a
    batched prefill: the tokens are transformers' still, beside a text request."""
    prompt, vision = engine.encode_images([image_message(png(1))])
    start = image_spans(prompt, engine.image_token)[0][0]
    small = MlxEngine(models[0], max_batch=4, prefill_chunk=start + 2)  # a plain first chunk ends inside it
    text = small.encode_chat([ChatMessage(role="user", content="Hi")])
    small.add_request("text", text, GREEDY)
    chunks: list[tuple[str, int, int]] = []
    forward = small._chunk_forward

    def spy(req: Any, cache: Any, start: int, end: int) -> Any:
        chunks.append((req.request_id, start, end))
        return forward(req, cache, start, end)

    small._chunk_forward = spy  # type: ignore[method-assign]
    ours = run(small, "img", prompt, vision)
    assert ours == reference(models[0], prompt, [png(1)], STEPS)
    image = [(s, e) for rid, s, e in chunks if rid == "img"]
    assert image[0] == (0, start) and image[1][0] == start and image[1][1] >= start + IMAGE_TOKENS, chunks


@pytest.mark.timeout(300)
def test_prefill_logits_equal_transformers_only_with_the_images_two_way_mask(models: tuple[Path, Path]) -> None:
    """The whole prompt's logits through mlx-lm's model with the tower's embeddings: transformers' within float32
    rounding where the image's tokens see each other both ways, and far off with mlx-lm's causal mask alone (a
    random model's greedy tokens can hide that)."""
    import io

    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm.models.cache import make_prompt_cache
    from PIL import Image
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    from skulk.engines.mlx.ring import inner_model
    from skulk.engines.mlx.vision import image_embeddings, image_masks, to_mlx

    engine = MlxEngine(models[0], max_batch=1)
    prompt, vision = engine.encode_images([image_message(png(1))])
    spans = image_spans(prompt, engine.image_token)
    model: Any = Gemma3ForConditionalGeneration.from_pretrained(str(models[0]), dtype=torch.float32).eval()
    processor: Any = AutoImageProcessor.from_pretrained(str(models[0]))
    pixels = processor(images=[Image.open(io.BytesIO(png(1))).convert("RGB")], return_tensors="pt")["pixel_values"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels,
                         token_type_ids=(ids == model.config.image_token_id).long()).logits[0]

    def ours(two_way: bool) -> torch.Tensor:
        cache, x = make_prompt_cache(engine.model), mx.array([prompt])
        embeds = image_embeddings(inner_model(engine.model), x, spans, 0, to_mlx(vision.embeds))
        if not two_way:
            return torch.from_numpy(np.array(engine.model(x, cache=cache, input_embeddings=embeds)[0]))
        with image_masks(cache, spans, 0):
            return torch.from_numpy(np.array(engine.model(x, cache=cache, input_embeddings=embeds)[0]))

    assert (ours(True) - expected).abs().max() < 1e-4
    assert (ours(False) - expected).abs().max() > 1e-2


@pytest.mark.timeout(120)
def test_the_engine_reads_images_and_the_card_offers_them_on_mlx(engine: MlxEngine, models: tuple[Path, Path]) -> None:
    assert isinstance(engine, Sees)
    config = json.loads((models[0] / "config.json").read_text())
    card = card_from_config("org/vlm", config, (models[0] / "model.safetensors").stat().st_size)
    assert card.vision and allows(card.compatible_backends, "mlx")
    text_model = MlxEngine(models[1], max_batch=2)
    with pytest.raises(PromptRejected, match="text only"):
        text_model.encode_images([image_message(png(1))])
    with pytest.raises(PromptRejected, match="cannot be decoded"):
        engine.encode_images([image_message(b"not a picture at all")])
    prompt, vision = engine.encode_images([image_message(png(1))])
    with pytest.raises(PromptRejected, match="placeholders"):
        engine.add_request("x", [p for p in prompt if p != engine.image_token], GREEDY, vision=vision)

"""Images into a vision-language model on the torch engine: a random Gemma 3 checkpoint's greedy tokens for an image
prompt equal transformers' own Gemma3ForConditionalGeneration's; a different image changes them and shares no
cached blocks; a text model refuses images; the placement helpers (spans, rows, whole-image chunks) are exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skulk.engines.errors import PromptRejected
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.tokenizer import ChatTokenizer
from skulk.engines.torch.vision import image_chunk, image_mask, image_rows, image_spans, whole_images
from skulk.formats.images import data_url
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import ChatMessage, SamplingParams
from tests.unit.vlm_checkpoint import IMAGE_TOKENS, TOKENS, png, reference, write_gemma3_vlm

GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)


def image_message(picture: bytes, text: str = "What is this?") -> ChatMessage:
    return ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture)}}, {"type": "text", "text": text}]})


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vlm")
    demo = ensure_demo_model(root / "models")
    return write_gemma3_vlm(root, demo), demo


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> TorchEngine:
    return TorchEngine(models[0], max_batch=4, block_size=4, prefill_chunk=64)


def generate(engine: TorchEngine, rid: str, message: ChatMessage) -> tuple[list[int], list[int]]:
    prompt, vision = engine.encode_images([message])
    engine.add_request(rid, prompt, GREEDY, vision=vision)
    out: list[int] = []
    while engine.has_work():
        out += [t.token_id for t in engine.step() if t.request_id == rid]
    return prompt, out


@pytest.mark.timeout(300)
def test_greedy_tokens_equal_transformers_and_depend_on_the_image(
    engine: TorchEngine, models: tuple[Path, Path]
) -> None:
    prompt, ours = generate(engine, "a", image_message(png(1)))
    spans = image_spans(prompt, engine.model.args.image_token_id)
    assert [e - s for s, e in spans] == [IMAGE_TOKENS]
    assert ours == reference(models[0], prompt, [png(1)])
    again_prompt, again = generate(engine, "b", image_message(png(1)))
    assert (again_prompt, again) == (prompt, ours)  # the same image twice: the same tokens (no cache mix-up)
    other_prompt, other = generate(engine, "c", image_message(png(2)))
    assert other_prompt == prompt and other != ours  # same placeholders, another image: its own answer
    assert other == reference(models[0], prompt, [png(2)])


@pytest.mark.timeout(120)
def test_a_text_model_and_a_bad_image_are_refused(engine: TorchEngine, models: tuple[Path, Path]) -> None:
    text_model = TorchEngine(models[1], max_batch=2)
    with pytest.raises(PromptRejected, match="text only"):
        text_model.encode_images([image_message(png(1))])
    with pytest.raises(PromptRejected, match="cannot be decoded"):
        engine.encode_images([image_message(b"not a picture at all")])


def test_spans_rows_and_chunks() -> None:
    prompt = [1, 9, 9, 9, 2, 9, 9, 3]
    spans = image_spans(prompt, 9)
    assert spans == ((1, 4), (5, 7))
    assert image_spans(prompt, None) == ()
    assert image_rows(spans, 2, 6) == ([0, 1, 3], [1, 2, 3])  # positions 2, 3, 5: image 0's 1, 2, image 1's 0
    assert whole_images(spans, 0, 3) == 1  # would end inside image 0: stops before it
    assert whole_images(spans, 1, 2) == 2  # image 0 starts here and is longer: split rather than stall
    assert whole_images(spans, 0, 4) == 4
    assert image_chunk(2, spans, 1, 64) == 3  # a riding chunk of 2 at image 0's start: the whole image
    assert image_chunk(2, spans, 1, 2) == 2 and image_chunk(2, spans, 0, 64) == 2  # capped; no image here
    assert image_chunk(8, spans, 5, 64) == 8
    mask = image_mask(spans, 0, 5, torch.device("cpu"))
    assert mask is not None and mask[0, 0, 1, 3] and not mask[0, 0, 0, 1] and not mask[0, 0, 4, 5 - 1 - 3]
    assert image_mask(spans, 7, 8, torch.device("cpu")) is None


def test_the_card_says_vision_and_counts_the_tower_on_the_first_rank(models: tuple[Path, Path]) -> None:
    """The tower and projector are in the checkpoint (staged with it): placement counts their bytes with the
    embedding's, on rank 0, where they run."""
    import json

    from skulk.models.catalog import card_from_config
    from skulk.models.memory_math import checkpoint_tensor_bytes

    path = models[0]
    tensors = checkpoint_tensor_bytes(path)
    tower = sum(b for name, b in tensors.items() if "vision_tower" in name or "multi_modal_projector" in name)
    card = card_from_config("org/vlm", json.loads((path / "config.json").read_text()),
                            sum(tensors.values()), tensors=tensors)
    assert card.vision and card.memory is not None and tower > 0
    assert card.memory.embed_bytes >= tower + 4 * card.hidden_size * (card.vocab_size or 0)
    text = card_from_config("org/text", json.loads((models[1] / "config.json").read_text()), 1)
    assert not text.vision


@pytest.mark.timeout(120)
def test_two_image_requests_share_a_small_pool_in_small_chunks(engine: TorchEngine, models: tuple[Path, Path]) -> None:
    """Together, in chunks of 6 around 4-token images, in a pool of 21 blocks (one is preempted and
    recomputed with its image): each gets its tokens alone."""
    alone = {rid: generate(engine, f"alone-{rid}", image_message(png(seed)))[1] for rid, seed in (("a", 1), ("b", 2))}
    small = TorchEngine(models[0], max_batch=2, block_size=4, prefill_chunk=6, max_seq=80, kv_cache_bytes=0)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for rid, seed in (("a", 1), ("b", 2)):
        prompt, vision = small.encode_images([image_message(png(seed))])
        small.add_request(rid, prompt, GREEDY, vision=vision)
    while small.has_work():
        for out in small.step():
            got[out.request_id].append(out.token_id)
    assert got == alone
    assert small.preemptions >= 1


@pytest.mark.timeout(120)
def test_the_tokenizer_alone_counts_an_image_as_the_runner_does(engine: TorchEngine, models: tuple[Path, Path]) -> None:
    """The API node counts a prompt (count_tokens) with the tokenizer alone, no tower: each image's marker expands
    to the run the runner's prompt holds, so the two agree; a text-only model has no run to expand."""
    two = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(1))}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(png(2))}}, {"type": "text", "text": "What are these?"}]})
    counted = ChatTokenizer(models[0]).encode_chat([two])
    prompt, _ = engine.encode_images([two])
    assert counted == prompt
    assert [e - s for s, e in image_spans(counted, engine.model.args.image_token_id)] == [IMAGE_TOKENS] * 2
    text = ChatTokenizer(models[0]).encode_chat([ChatMessage(role="user", content="What is this?")])
    assert engine.model.args.image_token_id not in text
    assert ChatTokenizer(models[1]).image_run is None

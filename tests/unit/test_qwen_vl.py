"""Images into Qwen2.5-VL on the torch engine: a random checkpoint in the published layout gives transformers' own
Qwen2_5_VLForConditionalGeneration's greedy tokens for an image prompt (the vision tower's embeddings in the
image-pad rows, multimodal rope over the image's grid and index + delta after it, in decode too) and for a text
prompt; the tokenizer alone expands each image to its grid's count; a bad image is refused; the rope index is
transformers' get_rope_index; the card counts the tower on the first rank."""

from __future__ import annotations

import functools
import io
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.errors import PromptRejected
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.mrope import MRope, mrope_index, rope_rows
from skulk.engines.torch.tokenizer import ChatTokenizer
from skulk.engines.torch.vision import image_spans
from skulk.formats.images import data_url
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import ChatMessage, SamplingParams
from tests.unit.qwen_vl_checkpoint import TOKENS, picture, reference, write_qwen25_vl

GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)
IMAGE_TOKENS = 8  # a 100x60 picture resizes to 112x56: 8x4 patches, 4x2 merged


def image_message(*pictures: bytes, text: str = "What is this?") -> ChatMessage:
    parts: list[dict[str, object]] = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures]
    return ChatMessage.model_validate({"role": "user", "content": [*parts, {"type": "text", "text": text}]})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen-vl")
    return write_qwen25_vl(root, ensure_demo_model(root / "models"))


@pytest.fixture(scope="module")
def engine(model: Path) -> TorchEngine:
    return TorchEngine(model, max_batch=4, block_size=4, prefill_chunk=64)


def run(engine: TorchEngine, requests: dict[str, ChatMessage]) -> dict[str, tuple[list[int], list[int]]]:
    """Each request's prompt and greedy tokens, all added before the first step."""
    prompts = {}
    for rid, message in requests.items():
        if message.images:
            prompt, vision = engine.encode_images([message])
            engine.add_request(rid, prompt, GREEDY, vision=vision)
        else:
            prompt = engine.encode_chat([message])
            engine.add_request(rid, prompt, GREEDY)
        prompts[rid] = prompt
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_work():
        for tok in engine.step():
            out[tok.request_id].append(tok.token_id)
    return {rid: (prompts[rid], out[rid]) for rid in requests}


@pytest.mark.timeout(300)
def test_greedy_tokens_equal_transformers_for_an_image_and_for_text(engine: TorchEngine, model: Path) -> None:
    got = run(engine, {"a": image_message(picture(1))})["a"]
    prompt, ours = got
    assert [e - s for s, e in image_spans(prompt, engine.model.args.image_token_id)] == [IMAGE_TOKENS]
    assert len(ours) == TOKENS and ours == reference(model, prompt, [picture(1)])
    other_prompt, other = run(engine, {"b": image_message(picture(2))})["b"]
    assert other_prompt == prompt and other != ours  # same placeholders, another image: its own answer
    assert other == reference(model, prompt, [picture(2)])
    text_prompt, text = run(engine, {"t": ChatMessage(role="user", content="Say something.")})["t"]
    assert engine.model.args.image_token_id not in text_prompt
    assert text == reference(model, text_prompt, [])


@pytest.mark.timeout(300)
def test_image_and_text_requests_together_in_small_chunks(engine: TorchEngine, model: Path) -> None:
    """Two images of different grids and a text prompt at once, prefilled in chunks of 5 riding on each other's
    decode steps (rows with and without multimodal rope in one batch): each gets its tokens alone."""
    requests = {"wide": image_message(picture(1)), "tall": image_message(picture(3, 60, 130)),
                "text": ChatMessage(role="user", content="Say something.")}
    alone = {rid: run(engine, {rid: message})[rid] for rid, message in requests.items()}
    small = TorchEngine(model, max_batch=3, block_size=4, prefill_chunk=5)
    assert run(small, requests) == alone
    assert alone["tall"][1] == reference(model, alone["tall"][0], [picture(3, 60, 130)])


@pytest.mark.timeout(120)
def test_the_tokenizer_alone_counts_each_image_by_its_grid(engine: TorchEngine, model: Path) -> None:
    """The API node counts a prompt with the tokenizer alone (no tower): each image's <|image_pad|> expands to the
    count its resized grid gives, the same tokens the runner's prompt holds and the tower's embeddings fill."""
    two = image_message(picture(1), picture(4, 300, 200), text="Compare them.")
    counted = ChatTokenizer(model).encode_chat([two])
    prompt, vision = engine.encode_images([two])
    assert counted == prompt
    runs = [e - s for s, e in image_spans(counted, engine.model.args.image_token_id)]
    assert runs == [t * h * w for t, h, w in vision.grids] == [IMAGE_TOKENS, vision.embeds.shape[0] - IMAGE_TOKENS]
    assert vision.grids[1] == (1, 4, 6)  # 300x200 over max_pixels (25088): shrunk to 168x112, 12x8 patches
    assert ChatTokenizer(model).image_run is None  # Gemma 3's fixed run is not this family's


@pytest.mark.timeout(120)
def test_a_bad_or_too_large_image_is_refused(engine: TorchEngine, model: Path) -> None:
    """What the runner answers with a 400 (invalid_request), on the runner's and the API node's counting path."""
    from PIL import Image

    huge = io.BytesIO()
    Image.new("RGB", (4097, 4097)).save(huge, format="PNG")
    for bad, why in ((b"not a picture at all", "cannot be decoded"), (huge.getvalue(), "more than")):
        with pytest.raises(PromptRejected, match=why):
            engine.encode_images([image_message(bad)])
        with pytest.raises(PromptRejected, match=why):
            ChatTokenizer(model).encode_chat([image_message(bad)])


def test_rope_index_is_transformers_get_rope_index() -> None:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    grids = [(1, 2, 4), (1, 3, 2)]
    prompt = [5] * 3 + [9] * 8 + [5] * 4 + [9] * 6 + [5] * 2
    spans = image_spans(prompt, 9)
    mrope = mrope_index(len(prompt), spans, grids)
    own: Any = Qwen2_5_VLModel  # its methods, called on a stand-in holding just the config they read
    fake = types.SimpleNamespace(config=Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2}),
                                 get_vision_position_ids=functools.partial(own.get_vision_position_ids, None))
    ids = torch.tensor([prompt])
    want, delta = own.get_rope_index(fake, ids, (ids == 9).int(),
                                     torch.tensor([[t, 2 * h, 2 * w] for t, h, w in grids]))
    assert mrope is not None and torch.equal(mrope.table, want[:, 0]) and mrope.delta == int(delta)
    assert mrope.delta == -7  # 8 + 6 image tokens at max(h, w) = 4 + 3 positions
    assert mrope.rows(len(prompt) - 1, len(prompt) + 2).tolist() == [[15, 16, 17]] * 3  # index + delta on
    assert mrope_index(len(prompt), spans, []) is None
    with pytest.raises(PromptRejected, match="grids"):
        mrope_index(len(prompt), spans, [(1, 2, 4), (1, 2, 2)])
    rows = rope_rows([(mrope, 4, 5), (None, 7, 8)], torch.device("cpu"))
    assert rows is not None and rows[:, :, 0].tolist() == [[3, 7], [3, 7], [4, 7]]
    assert rope_rows([(None, 0, 2)], torch.device("cpu")) is None
    assert isinstance(mrope, MRope)


def test_the_card_says_vision_and_counts_the_tower_on_the_first_rank(model: Path) -> None:
    from skulk.models.catalog import card_from_config
    from skulk.models.memory_math import checkpoint_tensor_bytes

    tensors = checkpoint_tensor_bytes(model)
    tower = sum(b for name, b in tensors.items() if name.startswith("visual."))
    card = card_from_config("org/qwen-vl", json.loads((model / "config.json").read_text()), sum(tensors.values()),
                            tensors=tensors)
    assert card.vision and card.torch_runtime == "native" and card.memory is not None and tower > 0
    assert card.memory.embed_bytes >= tower + 4 * card.hidden_size * (card.vocab_size or 0)
    assert card.n_layers == 4 and sum(layer.weight_bytes for layer in card.memory.layers) < sum(tensors.values())


@pytest.mark.timeout(300)
def test_speculative_decode_steps_rotate_as_plain_ones(model: Path) -> None:
    """Prompt lookup's verify chunk (local_step.Speculator.verify) rotates its rows at index + delta like a decode
    step: 48 tokens with drafting (some proposed) are the 48 without."""
    message = image_message(picture(1))
    long = SamplingParams(max_tokens=48, temperature=0)
    outs = []
    for speculate in (True, False):
        engine = TorchEngine(model, max_batch=2, block_size=4, prefill_chunk=64, speculate=speculate)
        prompt, vision = engine.encode_images([message])
        engine.add_request("s", prompt, long, vision=vision)
        got: list[int] = []
        while engine.has_work():
            got += [t.token_id for t in engine.step()]
        outs.append((got, engine.spec_drafted))
    (drafted_tokens, drafted), (plain, _) = outs
    assert drafted > 0 and len(plain) == 48 and drafted_tokens == plain


@pytest.mark.timeout(300)
def test_transformers_5s_own_layout_reads_the_same(engine: TorchEngine, model: Path, tmp_path: Path) -> None:
    """The same weights saved by transformers 5's save_pretrained (the language model's numbers in text_config,
    its rope under rope_parameters) give the published layout's tokens."""
    saved = write_qwen25_vl(tmp_path, ensure_demo_model(tmp_path / "models"), published=False)
    config = json.loads((saved / "config.json").read_text())
    assert "rope_parameters" in config["text_config"] and "rope_scaling" not in config
    other = TorchEngine(saved, max_batch=2, block_size=4, prefill_chunk=64)
    assert other.model.args.mrope_section == engine.model.args.mrope_section == (2, 3, 3)
    message = image_message(picture(1))
    assert run(other, {"a": message}) == run(engine, {"a": message})



def test_the_grids_ride_in_the_step_header_and_a_text_add_is_unchanged() -> None:
    """What rank 0 tells the later stages: an image add's grids round-trip; a text add's payload has no grids key
    (an older rank still reads it)."""
    from skulk.engines.torch.wire import Header, NewRequest, StepKind, decode_changes, encode_changes

    image = NewRequest.of("i", "c", [1, 2], GREEDY, ((1, 2, 4), (1, 3, 2)))
    text = NewRequest.of("t", "c", [1, 2], GREEDY)
    payload = encode_changes(Header(StepKind.PREFILL, adds=(image, text)))
    back = decode_changes(payload, 0).adds
    assert [a.grids for a in back] == [((1, 2, 4), (1, 3, 2)), ()]
    assert json.loads(payload)["adds"][1].keys() == {"request_id", "command_id", "prompt", "sampling"}

"""Time to first token of an image request (issue 42's image row), split into its parts, on the torch engine
in-process: one 512x512 PNG on the tiny random Gemma 3 VLM (tests/unit/vlm_checkpoint.py, the layout and chat
template of google/gemma-3-4b-it at tiny sizes), against the same prompt without the image.

Parts, each the median over --rounds interleaved rounds:
  preprocess   the data: URL's base64 decoded and the PNG opened (formats/images.py), then the image processor's
               resize and normalisation to the tower's size (transformers' Gemma3ImageProcessor)
  tower        SigLIP tower and projector over the pixels (engines/torch/vision.VisionTower)
  prefill      the engine's first step with the image's embeddings in place, to its first token
  text only    the same prompt without the image, to its first token (what the image adds is the difference)

Run: .venv/bin/python bench/vision.py [--rounds 7] [--size 512]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.vision import VisionInput, VisionTower, digest
from skulk.formats.images import image_bytes, open_image
from skulk.models.demo import ensure_demo_model
from skulk.types.chat import ChatMessage, SamplingParams

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository root: tests.unit's checkpoint, as moe.py
from tests.unit.vlm_checkpoint import png, write_gemma3_vlm


def _messages(url: str | None) -> list[ChatMessage]:
    parts: list[dict[str, object]] = [{"type": "text", "text": "What is in this picture?"}]
    if url is not None:
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [ChatMessage.model_validate({"role": "user", "content": parts})]


def _first_token(engine: TorchEngine, request_id: str, prompt: list[int], vision: VisionInput | None) -> float:
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), vision=vision)
    while not any(out.request_id == request_id for out in engine.step()):
        pass
    took = time.perf_counter() - started
    while engine.has_work():
        engine.step()
    return took


def one_round(engine: TorchEngine, url: str, n: int) -> dict[str, float]:
    """Each part of one image request's time to first token, and the text-only prompt's, in seconds."""
    tower = engine.vision_tower()
    assert isinstance(tower, VisionTower), "this bench times Gemma 3's tower (pixels, then project)"
    started = time.perf_counter()
    data = image_bytes(url)
    pixels = tower.pixels([open_image(data)])
    processed = time.perf_counter()
    embeds = tower.project(pixels)
    towered = time.perf_counter()
    prompt, _ = engine.encode_images(_messages(url))
    prefill = _first_token(engine, f"image-{n}", prompt, VisionInput(embeds, digest([data])))
    text = _first_token(engine, f"text-{n}", engine.encode_chat(_messages(None)), None)
    return {"preprocess": processed - started, "tower": towered - processed, "prefill": prefill, "text only": text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=512, help="the image's width and height in pixels")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_gemma3_vlm(root, ensure_demo_model(root / "demo"))
        engine = TorchEngine(model, max_seq=512)
        url = "data:image/png;base64," + base64.b64encode(png(1, args.size)).decode()
        one_round(engine, url, -1)  # warm: the tower loads at the first image
        rounds = [one_round(engine, url, n) for n in range(args.rounds)]
    print(f"one {args.size}x{args.size} PNG ({len(url) // 1024} KiB as a data: URL) on the tiny Gemma 3 VLM, "
          f"medians of {args.rounds} rounds, ms:")
    for part in ("preprocess", "tower", "prefill", "text only"):
        print(f"  {part:<11} {1000 * statistics.median(r[part] for r in rounds):8.2f}")
    ttft = statistics.median(r["preprocess"] + r["tower"] + r["prefill"] for r in rounds)
    print(f"  image TTFT  {1000 * ttft:8.2f}   (preprocess + tower + prefill)")


if __name__ == "__main__":
    main()

"""The torch engine's forward on a CUDA device, per weight format, against the device's memory bandwidth (issue 45).

Run by bench/cuda_check.sh on a machine with an NVIDIA GPU. On a random Llama of 3.2 1B's shape (skulk.testing.
random_llama), for bf16, int8 and int4 (torch's CUDA weight-only kernels, engines/torch/cuda_quant.py), it prints:
- single-stream decode tok/s and the bandwidth bound: a decode step reads every weight once, so one stream can
  make at most bandwidth ÷ weight bytes steps a second; the ratio of the two is the figure the issue targets (≥ 0.7);
- 32-stream aggregate decode tok/s (the same weights read once per step for 32 rows);
- prefill tok/s of one 512-token prompt.
The bandwidth is measured here (a device-to-device copy of 1 GiB: read + write bytes over time, which reaches
~85-90% of the data sheet's figure) and, for a GPU whose data sheet figure is known, also given as that; the ratio
is printed against both. The model runs as the engine runs it (ModelSlice with a paged cache, eager torch ops, no
CUDA graphs), with a synchronisation at the end of each timed run, not per step.

One line per result, `key: value` first, so a resolution note can quote the output as it is.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.models.demo import ensure_demo_model
from skulk.testing.random_llama import LLAMA_1B, write_random_llama

FORMATS = {"bf16": None, "int8": "int8", "int4": "int4"}
DATASHEET_GBPS = {"H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900, "H200": 4800, "A100-SXM4-80GB": 2039,
                  "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555, "L40S": 864, "L4": 300,
                  "RTX 4090": 1008, "A10": 600}
"""Data-sheet memory bandwidth (GB/s) by a substring of torch.cuda.get_device_name()."""
TARGET = 0.7
DEVICE = torch.device("cuda", 0)


def sync() -> None:
    """Wait for the device's queued kernels (a no-op for a CPU smoke run of this script's functions)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def copy_bandwidth(gib: int = 1, repeats: int = 20) -> float:
    """Bytes per second a device-to-device copy moves (each copy reads and writes `gib` GiB)."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    seconds = time.perf_counter() - start
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) * repeats / seconds


def datasheet(name: str) -> float | None:
    return next((gbps * 1e9 for key, gbps in DATASHEET_GBPS.items() if key in name), None)


def weight_bytes(model: ModelSlice) -> int:
    """Bytes of distinct storage a decode step reads (a stacked q/k/v and its parts' views count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers()) if t.device.type == DEVICE.type}
    return sum(storages.values())


def decode_tps(model: ModelSlice, streams: int, tokens: int, prompt: int = 16, block: int = 32) -> float:
    """Greedy decode of `streams` rows after a `prompt`-token prefill, each stream's blocks scattered over a paged
    pool as a long-running server's are; the first 4 steps warm up and are not timed."""
    size = prompt + tokens + 4
    per = -(-size // block)
    cache = model.make_cache(streams * per, block)
    order = torch.randperm(streams * per, generator=torch.Generator().manual_seed(1))
    tables = order.to(torch.int32).view(streams, per).to(DEVICE)
    with torch.inference_mode():
        ids = torch.randint(0, model.args.vocab_size, (streams, prompt), device=DEVICE)
        positions = torch.arange(prompt, device=DEVICE).repeat(streams, 1)
        model(ids, StepBatch.build(positions, tables, kv_len=prompt), cache, last_only=True)
        next_ids = torch.zeros(streams, 1, dtype=torch.long, device=DEVICE)
        start = 0.0
        for step in range(tokens + 4):
            if step == 4:
                sync()
                start = time.perf_counter()
            at = torch.full((streams, 1), prompt + step, device=DEVICE)
            logits = model(next_ids, StepBatch.build(at, tables, kv_len=prompt + step + 1), cache)
            next_ids = logits[:, -1].argmax(-1, keepdim=True)
        sync()
    return streams * tokens / (time.perf_counter() - start)


def prefill_tps(model: ModelSlice, length: int) -> float:
    """One prompt of `length` tokens in one step (the best of two: the first pays for the kernels' first launch)."""
    best = 0.0
    for _ in range(2):
        cache = model.make_cache(1, length)
        with torch.inference_mode():
            ids = torch.randint(0, model.args.vocab_size, (1, length), device=DEVICE)
            positions = torch.arange(length, device=DEVICE).unsqueeze(0)
            sync()
            start = time.perf_counter()
            model(ids, StepBatch.build(positions, 0, kv_len=length), cache, last_only=True)
            sync()
        best = max(best, length / (time.perf_counter() - start))
    return best


def measure(path: Path, name: str, args: argparse.Namespace, bandwidth: float, sheet: float | None) -> None:
    started = time.perf_counter()
    model = load_model(path, device=DEVICE, quantize=FORMATS[name])
    size = weight_bytes(model)
    print(f"{name} load_s: {time.perf_counter() - started:.1f}  weight_GB: {size / 1e9:.3f}", flush=True)
    single = decode_tps(model, 1, args.tokens)
    bound = bandwidth / size
    line = f"{name} decode_1_stream_tok_s: {single:.1f}  bound_tok_s: {bound:.1f}  ratio: {single / bound:.2f}"
    if sheet is not None:
        line += f"  ratio_vs_datasheet: {single / (sheet / size):.2f}"
    print(f"{line}  target: >= {TARGET}  {'MET' if single / bound >= TARGET else 'NOT MET'}", flush=True)
    aggregate = decode_tps(model, args.streams, args.tokens)
    print(f"{name} decode_{args.streams}_streams_aggregate_tok_s: {aggregate:.1f}  "
          f"per_stream: {aggregate / args.streams:.1f}", flush=True)
    print(f"{name} prefill_{args.prefill}_tok_s: {prefill_tps(model, args.prefill):.1f}", flush=True)
    del model
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: torch " + torch.__version__ + " sees none (make run CUDA=1 installs the "
                         "CUDA build)")
    name = torch.cuda.get_device_name(0)
    sheet = datasheet(name)
    bandwidth = copy_bandwidth()
    print(f"bench_gpu: {name}  torch: {torch.__version__}  cuda: {torch.version.cuda}", flush=True)
    print(f"bandwidth_copy_GBps: {bandwidth / 1e9:.0f}  bandwidth_datasheet_GBps: "
          f"{f'{sheet / 1e9:.0f}' if sheet else 'unknown'}  (the ratios below use the measured copy)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        path = write_random_llama(Path(tmp) / "llama1b", LLAMA_1B, ensure_demo_model(Path(tmp) / "demo"))
        print(f"model: random Llama 3.2 1B shape {LLAMA_1B}  written_s: {time.perf_counter() - started:.1f}",
              flush=True)
        for fmt in args.formats.split(","):
            measure(path, fmt, args, bandwidth, sheet)


if __name__ == "__main__":
    main()

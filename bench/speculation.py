"""Speculative decoding measured side by side in one run (CPU, in-process, nothing downloaded).

On a real checkpoint (--model-dir, e.g. SmolLM2-135M-Instruct in bf16), decode tok/s of one stream ÷ plain decoding
of the same request, rounds interleaved so every figure sees the same machine:
  prompt lookup, greedy, on the issue's code-editing prompt (the answer repeats much of it)    (target >= 1.5)
  prompt lookup, sampled (temperature 0.7, seeded; the rejection rule) on the same prompt
  a draft model, greedy: the target quantized to int4 at load (same tokenizer, same layers), and a copy of the
    target cut to its first --draft-layers layers, on the code edit and on an open question
with each one's acceptance (accepted ÷ drafted draft tokens) and whether greedy output equals plain decoding's.

Run: .venv/bin/python bench/speculation.py --model-dir DIR [--rounds 3] [--threads 2] [--draft-layers 8]

Measured (SmolLM2-135M-Instruct bf16, 1 thread, the shared 2-core EPYC at load 9-12, two runs of 2 rounds):
prompt lookup on the code edit 2.64 and 2.81 x plain (acceptance 62 %), sampled 1.96 and 1.92 (54 %); the int4
draft 1.00 and 1.35 on the code edit (85 %), 0.85 and 1.15 on the open question (52 %): on a CPU a 135M model's
int4 step costs most of a bf16 one, so four draft steps eat the gain. A layer-cut copy (8 or 20 of 30 layers)
writes nonsense and is accepted 0-4 %. Greedy output equals plain on the code edit; on the open question both
prompt lookup and the draft part at token 49, an exact bf16 tie ('.' and ',' at the same log-probability).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from paged import EDIT  # the code-editing prompt of bench/paged.py (a sibling script: its folder is on sys.path)
from skulk.engines.torch.engine import TorchEngine
from skulk.types.chat import ChatMessage, SamplingParams

OPEN = "Write a short story about a fox who learns to swim."
GREEDY = SamplingParams(max_tokens=200, temperature=0)
SAMPLED = SamplingParams(max_tokens=200, temperature=0.7, seed=1)


@dataclass
class Case:
    name: str
    engine: TorchEngine
    prompt: list[int]
    sampling: SamplingParams
    speeds: list[float]
    tokens: list[int]


def truncated(model_dir: Path, layers: int, into: Path) -> Path:
    """A copy of the checkpoint keeping only its first `layers` layers (the embedding, final norm and head kept):
    a draft of the same tokenizer, made from the target itself."""
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(config))
    for name in os.listdir(model_dir):
        if name.startswith("tokenizer") or name == "generation_config.json":
            (into / name).write_bytes((model_dir / name).read_bytes())
    weights = load_file(str(model_dir / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if ".layers." not in k or int(k.split(".")[2]) < layers}
    save_file(kept, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


def run_once(case: Case, rid: str) -> None:
    """One request alone; its decode tok/s after the first token (prefill excluded)."""
    case.engine.add_request(rid, case.prompt, case.sampling)
    tokens: list[int] = []
    while not tokens:
        tokens += [o.token_id for o in case.engine.step()]
    started = time.perf_counter()
    while case.engine.has_work():
        tokens += [o.token_id for o in case.engine.step()]
    case.speeds.append((len(tokens) - 1) / (time.perf_counter() - started))
    case.tokens = tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft-layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model_dir
    with tempfile.TemporaryDirectory() as tmp:
        cut = truncated(model, args.draft_layers, Path(tmp) / "cut")
        plain = TorchEngine(model, max_seq=2048, speculate=False)
        lookup = TorchEngine(model, max_seq=2048)
        int4 = TorchEngine(model, max_seq=2048, draft_dir=model, draft_quantize="int4")
        layers = TorchEngine(model, max_seq=2048, draft_dir=cut)
        edit = plain.encode_chat([ChatMessage(role="user", content=EDIT)])
        story = plain.encode_chat([ChatMessage(role="user", content=OPEN)])
        cases = [Case(n, e, p, s, [], []) for n, e, p, s in (
            ("plain, code edit", plain, edit, GREEDY),
            ("prompt lookup, code edit", lookup, edit, GREEDY),
            ("plain, code edit, sampled", plain, edit, SAMPLED),
            ("prompt lookup, code edit, sampled", lookup, edit, SAMPLED),
            ("draft int4, code edit", int4, edit, GREEDY),
            (f"draft {args.draft_layers} layers, code edit", layers, edit, GREEDY),
            ("plain, open question", plain, story, GREEDY),
            ("draft int4, open question", int4, story, GREEDY),
            (f"draft {args.draft_layers} layers, open question", layers, story, GREEDY),
        )]
        stats = Stats.install()
        for round_ in range(args.rounds + 1):  # round 0 warms up; interleaved so load hits every case alike
            for i, case in enumerate(cases):
                stats.current = case.name
                run_once(case, f"r{round_}-{i}")
                if round_ == 0:
                    case.speeds.clear()
                    stats.counts[case.name] = [0, 0]
        report(cases, stats)


class Stats:
    """Accepted and drafted draft tokens per case, from the engine's acceptance log line (the runbook's)."""

    def __init__(self) -> None:
        self.current = ""
        self.counts: dict[str, list[int]] = {}

    @classmethod
    def install(cls) -> Stats:
        import logging

        stats = cls()

        class Catch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                message = record.getMessage()
                if message.startswith("MTP acceptance"):
                    accepted, drafted = message.split(": ")[1].split()[0], message.split(" of ")[1].split()[0]
                    count = stats.counts.setdefault(stats.current, [0, 0])
                    count[0] += int(accepted)
                    count[1] += int(drafted)

        logger = logging.getLogger("skulk.engines.torch.admission")
        logger.setLevel(logging.INFO)
        logger.addHandler(Catch())
        return stats


def report(cases: list[Case], stats: Stats) -> None:
    plains = {(id(c.prompt), c.sampling.temperature): c for c in cases if c.name.startswith("plain")}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {torch.get_num_threads()} threads")
    for case in cases:
        ref = plains[id(case.prompt), case.sampling.temperature]
        speed = statistics.median(case.speeds)
        line = f"{case.name:40} {speed:6.1f} tok/s"
        if case is not ref:
            ratio = statistics.median(s / p for s, p in zip(case.speeds, ref.speeds, strict=True))
            accepted, drafted = stats.counts.get(case.name, [0, 0])
            rate = f"{100 * accepted / drafted:.0f} % of {drafted}" if drafted else "none drafted"
            same = "" if case.sampling.temperature > 0 else f", output equals plain: {case.tokens == ref.tokens}"
            line += f"  ÷ plain {ratio:5.2f}  acceptance {rate}{same}"
        print(line)


if __name__ == "__main__":
    main()

"""Turn a GGUF file (llama.cpp's format: Ollama's and LM Studio's downloads) into a model directory the engine
loads natively, and a card for the catalog.

The directory holds what our loader and tokenizer read, derived once from the file's own metadata by
transformers' GGUF support (config.json, tokenizer.json, tokenizer_config.json with the file's chat template,
generation_config.json), next to the GGUF file itself, linked rather than copied where the filesystem allows.
The weights stay in the file: engines/torch/gguf_file.py reads its quantized blocks as our affine groups at load.
config.json's `quantization` section lists each quantized module's bits (4, or 8 for the types widened), as an
MLX checkpoint's does, so placement, cards and the loader treat both alike.

That holds for the architectures whose GGUF tensors the torch engine reads natively (NATIVE_ARCHS). A file of
models/gguf_moe.DEQUANTIZED_ARCHS (DeepSeek V3, GLM-4 MoE, gpt-oss, Qwen3-Next, Qwen3.5: native torch families
from safetensors only) becomes instead the dequantized Hugging Face checkpoint the torch engine, its fallback and mlx-lm
read; any other architecture is refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from skulk.formats import InvalidModelFile
from skulk.models.catalog import card_from_config
from skulk.store.files import model_dir_name, write_marker
from skulk.types.backends import BackendTag
from skulk.types.memory import Memory
from skulk.types.models import ModelCard

GGUF_NAME = "model.gguf"
GGUF_BACKENDS: list[BackendTag] = ["torch", "torch-cpu", "torch-cuda", "mlx", "mlx-cpu", "mlx-metal"]
"""The torch engine reads GGUF blocks (engines/torch/gguf_file.py); an MLX rank loads the file's bf16 export
(models/gguf_export.py), except for Llama 3 rope scaling (rope_freqs), which that export cannot carry."""
TORCH_BACKENDS: list[BackendTag] = [t for t in GGUF_BACKENDS if t.startswith("torch")]
NATIVE_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
"""llama.cpp architectures the torch engine runs from the file's own blocks (engines/torch/gguf_file.py)."""
GROUP = 32
"""Every GGUF block type maps onto affine groups of 32 columns (engines/torch/gguf_file.py)."""
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


class NotGGUF(InvalidModelFile):
    """The file is not a GGUF file, or one whose architecture or tokenizer the engine cannot run."""


def default_model_id(gguf_path: Path) -> str:
    """gguf/<file stem>, lower-cased: a local import never collides with a Hugging Face id."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf_path.stem).strip("-.") or "model"
    return f"gguf/{stem}"


def import_gguf(gguf_path: Path, models_dir: Path, model_id: str | None = None, *, copy: bool = False) -> ModelCard:
    """Stage gguf_path as model_id under models_dir (written whole, then renamed) and return its card.
    A file of a family the torch engine runs natively (NATIVE_ARCHS) stays a GGUF file, hard-linked when it can
    be, else symlinked (copy=False) or copied; one of DEQUANTIZED_ARCHS becomes the Hugging Face checkpoint
    the transformers fallback and mlx-lm load (models/gguf_moe.py), and the file is not kept. NotGGUF for a
    file that is not one, or of an architecture no engine here runs (named); InvalidModelFile for a header
    out of bounds (checked before transformers reads a byte of it: skulk.formats.gguf_header)."""
    from skulk.formats.gguf_header import check_gguf

    if not is_gguf(gguf_path):
        raise NotGGUF(f"{gguf_path} is not a GGUF file")
    check_gguf(gguf_path)  # a hostile header is refused before the readers below are even imported
    from skulk.engines.torch.gguf_file import read_layout
    from skulk.models.gguf_moe import DEQUANTIZED_ARCHS

    layout = read_layout(gguf_path)
    arch = str(layout["arch"])
    if arch not in NATIVE_ARCHS + DEQUANTIZED_ARCHS:
        raise NotGGUF(f"{gguf_path.name}: llama.cpp architecture {arch!r} is not one Skulk runs from GGUF "
                      f"(it imports {', '.join(NATIVE_ARCHS + DEQUANTIZED_ARCHS)})")
    model_id = model_id or default_model_id(gguf_path)
    target = models_dir / model_dir_name(model_id)
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-gguf-", dir=models_dir))
    try:
        if arch in DEQUANTIZED_ARCHS:  # the file is read once, where it is, for its tensors and tokenizer
            _place_file(gguf_path.resolve(), tmp / GGUF_NAME, copy=False)
            card = _import_checkpoint(tmp, model_id, layout)
        else:
            _place_file(gguf_path.resolve(), tmp / GGUF_NAME, copy=copy)
            card = _import_native(tmp, model_id, layout)
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_marker(target, model_id, {p.name: p.stat().st_size for p in target.iterdir() if p.is_file()})
    return card


def _import_native(folder: Path, model_id: str, layout: dict[str, Any]) -> ModelCard:
    """config.json and the tokenizer beside the file the torch engine reads; an MLX rank loads its bf16 export."""
    config = gguf_config(folder / GGUF_NAME, layout)
    _write_json(folder / "config.json", config)
    _write_tokenizer(folder)
    card = card_from_config(model_id, config, int(layout["size"]))
    card = card.model_copy(update=dict(zip(("layer_bytes", "head_bytes"), stored_decode_bytes(config["gguf"]),
                                           strict=True)))
    if "rope_freq_factors" in config:
        return card.model_copy(update={"compatible_backends": TORCH_BACKENDS})
    return card.model_copy(update={"compatible_backends": GGUF_BACKENDS, "mlx_storage_size": Memory.from_bytes(
        bf16_export_bytes(folder / GGUF_NAME, config["gguf"]))})


def _import_checkpoint(folder: Path, model_id: str, layout: dict[str, Any]) -> ModelCard:
    """The dequantized checkpoint, config and tokenizer; the card is card_from_config's for it (the engines
    that run the family, its bytes those written) and the staged link to the file goes."""
    from skulk.models.gguf_moe import TORCH_ONLY_ARCHS, UnreadableMetadata, write_checkpoint

    try:
        config, sizes = write_checkpoint(folder / GGUF_NAME, folder, layout)
    except UnreadableMetadata as exc:
        raise NotGGUF(f"{model_id}: {exc}") from exc
    _write_tokenizer(folder, known_arch=False)
    (folder / GGUF_NAME).unlink()
    card = card_from_config(model_id, config, sum(p.stat().st_size for p in folder.glob("*.safetensors")), sizes)
    if layout["arch"] in TORCH_ONLY_ARCHS:
        backends = [t for t in card.compatible_backends or GGUF_BACKENDS if t.startswith("torch")]
        card = card.model_copy(update={"compatible_backends": backends, "mlx_splits": None})
    return card


def stored_decode_bytes(layout: dict[str, Any]) -> tuple[int, int]:
    """(every layer's bytes, the head's) as stored in the file (read_layout's tensors): the blocks of `blk.*`, and
    `output` (else the tied `token_embd`) with `output_norm`, which the last rank reads each decode step
    (card.layer_bytes, card.head_bytes: placement balances a Pipeline by them, master/balance.py)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def size(name: str) -> int:
        qtype, shape, _ = layout["tensors"][name]
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        return math.prod(shape) // block * block_bytes

    names = layout["tensors"]
    layers = sum(size(n) for n in names if n.startswith("blk."))
    head = size("output.weight" if "output.weight" in names else "token_embd.weight") if names else 0
    return layers, head + (size("output_norm.weight") if "output_norm.weight" in names else 0)


def bf16_export_bytes(path: Path, layout: dict[str, Any] | None = None) -> int:
    """The weights of the file's bf16 export (models/gguf_export.py), which an MLX rank loads instead of the
    file: every tensor an engine reads (those with a Hugging Face name), two bytes a value. Placement counts
    these for MLX ranks (card.mlx_storage_size). The import passes the layout it has already read: parsing the
    header again (its tokenizer arrays) cost seconds per import."""
    from skulk.engines.torch.gguf_file import GGUFCheckpoint

    return 2 * sum(math.prod(t.shape) for t in GGUFCheckpoint(path, layout).tensors.values())


def is_gguf(path: Path) -> bool:
    """A GGUF file starts with the magic bytes GGUF."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _place_file(source: Path, dest: Path, *, copy: bool) -> None:
    if copy:
        shutil.copyfile(source, dest)
        return
    try:
        os.link(source, dest)
    except OSError:  # another filesystem, or a store we may not link into: point at it instead
        dest.symlink_to(source)


def gguf_config(path: Path, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Hugging Face config.json for the file (transformers' reading of its metadata), in bfloat16, with the
    quantization section our loader reads (layout: read_layout's, where the caller has read it)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from skulk.engines.torch.gguf_file import GGUFCheckpoint, read_layout, rope_freq_factors

    try:
        config: dict[str, Any] = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise NotGGUF(f"{path.name}: transformers cannot read this GGUF file: {exc}") from exc
    config.pop("_model_name_or_path", None)
    model_type = _MODEL_TYPES.get(str(config.get("model_type")), str(config.get("model_type")))
    config["model_type"] = model_type
    config["architectures"] = [_ARCHITECTURES.get(model_type, "LlamaForCausalLM")]
    config["torch_dtype"] = "bfloat16"
    layout = layout or read_layout(path)
    for key, value in layout["config"].items():  # what transformers' mapping of this architecture left out
        config.setdefault(key, value)
    config["gguf"] = layout
    factors = rope_freq_factors(path, layout)
    if factors is not None:  # Llama 3 rope scaling, as llama.cpp's converter writes it
        config["rope_freq_factors"] = factors
    checkpoint = GGUFCheckpoint(path, layout)
    if "tie_word_embeddings" not in config:
        config["tie_word_embeddings"] = "lm_head.weight" not in checkpoint.tensors
    modules = checkpoint.quantized_modules()
    if modules:
        common = Counter(modules.values()).most_common(1)[0][0]
        section: dict[str, Any] = {"group_size": GROUP, "bits": common}
        section.update({m: {"bits": b, "group_size": GROUP} for m, b in sorted(modules.items()) if b != common})
        config["quantization"] = section
    return config


def _write_tokenizer(folder: Path, *, known_arch: bool = True) -> None:
    """tokenizer.json and tokenizer_config.json (with the file's chat template) from the file's tokenizer
    metadata, and generation_config.json with its end-of-turn ids. AutoTokenizer reads the file's config
    first, which transformers refuses for an architecture its GGUF mapping does not know (known_arch=False):
    the fast tokenizer is then built from the tokenizer metadata alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reader: Any = AutoTokenizer if known_arch else PreTrainedTokenizerFast
    try:
        tok: Any = reader.from_pretrained(str(folder), gguf_file=GGUF_NAME, local_files_only=True)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise NotGGUF(f"transformers cannot build this GGUF file's tokenizer: {exc}") from exc
    tok.save_pretrained(str(folder))
    template = folder / "chat_template.jinja"
    tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if template.is_file():  # one place for the template, where every reader of tokenizer_config.json looks
        tok_config["chat_template"] = template.read_text(encoding="utf-8")
        template.unlink()
    tok_config["model_max_length"] = min(int(tok_config.get("model_max_length") or 0) or 1 << 20, 1 << 20)
    _write_json(folder / "tokenizer_config.json", tok_config)
    eos = {tok.eos_token_id} | {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>",
                                                                         "<|endoftext|>") if t in tok.get_vocab()}
    eos.discard(None)
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": sorted(eos)}
    _write_json(folder / "generation_config.json", generation)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def import_source(source: str, models_dir: Path, model_id: str | None = None,
                  ollama_models: str | None = None) -> ModelCard:
    """Import what `skulk models import` and POST /models/import name: an absolute path to a .gguf file on this
    node, or `ollama:<name>[:tag]` from the local Ollama store (ollama_models, else $OLLAMA_MODELS, else
    ~/.ollama/models; its blob linked in place). ValueError (NotGGUF, OllamaModelNotFound) for a source that is
    not one."""
    from skulk.models.ollama_store import PREFIX, find_blob, model_id_for, ollama_store

    if source.startswith(PREFIX):
        blob = find_blob(source, ollama_store(ollama_models))
        return import_gguf(blob, models_dir, model_id or model_id_for(source))
    path = Path(source).expanduser()
    if not path.is_absolute():
        raise NotGGUF(f"{source!r}: give an absolute path to a .gguf file on the node, or ollama:<name>[:tag]")
    if not path.is_file():
        raise NotGGUF(f"{source}: no such file on this node")
    return import_gguf(path, models_dir, model_id)

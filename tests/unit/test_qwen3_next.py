"""Qwen3-Next on the torch engine's own layers (engines/torch/models/qwen3_next.py), against transformers' modeling.

family_checkpoints' seeded random checkpoint (three gated-DeltaNet layers, then one gated full-attention layer,
every MLP a MoE with a gated shared expert), and a variant whose norms, decays and conv kernels are drawn (the
shared one keeps transformers' initial values: zero norm weights, dt_bias one). Their 16 greedy tokens for two
prompts of different lengths, decoded together, are transformers' (its forward over the whole sequence each
step): so neither stream's linear-attention state leaks into the other's. So are they through a two-stage
pipeline (each stage building only its layers and their states) and two tensor-parallel ranks (each holding half
of every layer's heads and their states), with the second request arriving while the first decodes (its chunks
ride on the decode step, beside the decode row the engine computes and drops for it), and for a request admitted
after another left (its state starts from zeros; the leaver's was freed). A prompt longer than the delta rule's
chunk, prefilled in two engine chunks, ends on transformers' logits, and bfloat16 stays near transformers'
bfloat16. The engine shares no prefixes and speculates none for the family, a preempted request restarts from
zeros, and the catalog cards the family as native."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from skulk.engines.torch.cache import StepBatch
from skulk.engines.torch.engine import TorchEngine
from skulk.engines.torch.loader import load_model
from skulk.engines.torch.model import ModelSlice
from skulk.engines.torch.models.qwen3_next import GatedAttention, GatedDeltaNet, Qwen3NextLayer, StreamStates
from skulk.engines.torch.wire import Started
from skulk.models.catalog import card_from_config
from skulk.types.chat import SamplingParams
from tests.unit.family_checkpoints import (
    COMMON,
    FAMILIES,
    PROMPTS,
    TOKENS,
    disagreement,
    reference,
    save_drawn,
    tokenizer_donor,
)
from tests.unit.family_checkpoints import write as write_family
from tests.unit.test_fallback_families import run
from tests.unit.test_glm4_moe import (
    assert_bf16_near_transformers,
    assert_mixed_step_tokens,
    assert_tensor_ranks_match,
    assert_transformers_tokens,
    one_thread,  # noqa: F401 - the module's autouse fixture: one torch thread for tiny models
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # real model compute: `make test`, not `make test-fast`

GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)


def _write_drawn(root: Path, demo: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The variant: norm weights, A_log, dt_bias and conv kernels drawn, the layers linear, full, linear, full."""
    import transformers

    torch.manual_seed(1)
    shape: dict[str, Any] = FAMILIES["qwen3_next"][2] | {"layer_types": ["linear_attention", "full_attention"] * 2}
    config = transformers.Qwen3NextConfig(**(COMMON | shape))
    model = transformers.Qwen3NextForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                tensor.normal_(0.5, 0.3)
            elif name.endswith("A_log"):
                tensor.uniform_(-1, 1)
    return save_drawn(model, root, "qwen3_next_drawn", dtype, demo)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3-next")
    demo = tokenizer_donor(root)
    return {"shared": write_family("qwen3_next", root, demo), "drawn": _write_drawn(root, demo),
            "drawn_bf16": _write_drawn(root, demo, torch.bfloat16)}


@pytest.mark.parametrize("name", ["shared", "drawn"])
def test_greedy_tokens_are_transformers_on_one_rank_and_a_pipeline(name: str, checkpoints: dict[str, Path]) -> None:
    """Both prompts decoded together on one rank (their states side by side in each linear layer's pool), and
    through stages [0, 2) and [2, 4)."""
    assert_transformers_tokens(checkpoints[name])


def test_two_pipeline_ranks_give_transformers_tokens(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Two rank processes, layers [0, 2) (linear only: no KV block to hold) and [2, 4): each builds its own layers
    and their states and follows rank 0's headers (micro-batched, 8-token chunks: decode rows of a request still
    being prefilled ride along and are dropped), and the sampler's tokens are transformers'."""
    from skulk.testing.nodes import free_port
    from tests.unit.rank_jobs import launch

    path = checkpoints["shared"]
    port, out = free_port(), tmp_path / "pipeline.json"
    launch("mixed_rank.py", [{"model": str(path), "rank": rank, "port": port, "layers": [[0, 2], [2, 4]],
                              "engines": ["torch", "torch"], "prompts": PROMPTS, "tokens": TOKENS,
                              "out": str(out), "max_seq": 64, "block_size": 4} for rank in range(2)], 300)
    got = json.loads(out.read_text())["tokens"]
    assert (why := disagreement(got, reference(path))) is None, why


@pytest.mark.parametrize("name", ["shared", "drawn"])
def test_two_tensor_parallel_ranks_give_one_ranks_logits(name: str, checkpoints: dict[str, Path]) -> None:
    """Each rank holds half the heads of every layer, linear ones included (its key heads' rows of in_proj_qkvz
    and in_proj_ba, its q, k and v channels of the conv, its value heads' decays), half of every expert and of the
    shared expert; the all-reduced logits are one rank's."""
    assert_tensor_ranks_match(checkpoints[name])


def test_two_tensor_rank_processes_give_transformers_tokens(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    assert_tensor_rank_processes_give_transformers_tokens(checkpoints["drawn"], tmp_path)


def assert_tensor_rank_processes_give_transformers_tokens(path: Path, tmp_path: Path) -> None:
    """The engine over two Tensor rank processes (gloo): both prompts' tokens are transformers' (Qwen3.5 holds its
    family to the same)."""
    from skulk.testing.nodes import free_port
    from tests.unit.rank_jobs import launch

    port, out = free_port(), tmp_path / "tensor.json"
    launch("mixed_rank.py", [{"model": str(path), "rank": rank, "port": port, "layers": [[0, 4], [0, 4]],
                              "kind": "tensor", "engines": ["torch", "torch"], "prompts": PROMPTS, "tokens": TOKENS,
                              "out": str(out), "max_seq": 64, "block_size": 4, "dtype": "float32"}
                             for rank in range(2)], 300)
    got = json.loads(out.read_text())["tokens"]
    assert (why := disagreement(got, reference(path))) is None, why


def test_bfloat16_stays_near_transformers(checkpoints: dict[str, Path]) -> None:
    """A bfloat16 checkpoint in bfloat16 on both sides (the recurrent state float32 on both): each position's
    logits within 3% of transformers' (test_glm4_moe's check; measured at most 2.3% here)."""
    assert_bf16_near_transformers(checkpoints["drawn_bf16"])


def test_linear_layers_hold_no_kv_block(checkpoints: dict[str, Path]) -> None:
    """A linear layer's past is its states: its KV pool has no block, and a position costs only the full layer's
    keys and values (a slice of linear layers only: 1 byte, so it sizes its pool by the streams' ceiling)."""
    model = load_model(checkpoints["shared"])
    cache = model.make_cache(8, 16)
    assert [layer.keys.shape[0] for layer in cache.layers] == [0, 0, 0, 8]
    assert model.kv_bytes_per_token() == 2 * 2 * 16 * 4  # one layer: a key and a value, 2 heads x 16, float32
    assert load_model(checkpoints["shared"], end_layer=3).kv_bytes_per_token() == 1


def test_a_request_arriving_mid_decode_rides_on_it(checkpoints: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert_mixed_step_tokens(checkpoints["drawn"], GatedAttention, monkeypatch)


def _one_by_one(engine: TorchEngine, order: list[int]) -> dict[str, list[int]]:
    """Each prompt of `order` alone, the next added once the last has left."""
    got: dict[str, list[int]] = {}
    for i in order:
        rid = f"r{i}" if f"r{i}" not in got else f"again{i}"
        engine.add_request(rid, PROMPTS[i], GREEDY)
        got[rid] = []
        while engine.has_work():
            for out in engine.step():
                assert out.error is None, out.error
                got[out.request_id].append(out.token_id)
    return got


def _linear_layers(model: ModelSlice) -> list[GatedDeltaNet]:
    return [layer.linear_attn for layer in model.layers.values()
            if isinstance(layer, Qwen3NextLayer) and layer.linear_attn is not None]


def test_a_stream_admitted_after_another_left_starts_clean(checkpoints: dict[str, Path]) -> None:
    """One row: r0, then r1, then r0's prompt again; each gives transformers' tokens, and a request's states are
    freed when it leaves (none held once the engine is idle)."""
    path = checkpoints["drawn"]
    engine = TorchEngine(path, max_batch=1, max_seq=64)
    got = _one_by_one(engine, [0, 1, 0])
    expected = reference(path)
    assert got.pop("again0") == got["r0"]
    assert (why := disagreement(got, expected)) is None, why
    layers = _linear_layers(engine.model)
    assert len(layers) == 2 and all(layer.states.streams == 0 for layer in layers)


def test_preempted_requests_restart_from_a_clean_state(checkpoints: dict[str, Path]) -> None:
    """A pool of one whole-context request (11 blocks of 4 for 40 positions): the two requests' growth (9 and 6
    blocks) preempts the second, whose blocks (and states) go back; recomputed from its first position later, both
    still give transformers' tokens, and no state is held once they have left."""
    path = checkpoints["drawn"]
    engine = TorchEngine(path, max_batch=2, max_seq=40, block_size=4, prefill_chunk=8, kv_cache_bytes=1)
    assert engine.blocks.num_blocks == 11
    got = run(engine)
    assert engine.preemptions > 0
    assert (why := disagreement(got, reference(path))) is None, why
    assert all(layer.states.streams == 0 for layer in _linear_layers(engine.model))


def test_the_engine_shares_no_prefix_and_speculates_none(checkpoints: dict[str, Path]) -> None:
    """A shared block carries no linear-attention state, and a rejected draft would leave it past the kept
    tokens: the family's `stateful` flag turns both off. The same prompt again starts from its first position
    (a family without state would reuse the blocks the first one left)."""
    engine = TorchEngine(checkpoints["shared"], max_batch=2, max_seq=64, block_size=4)
    assert not engine.share_prefixes and not engine.speculate and engine.model.family.stateful
    got = _one_by_one(engine, [0, 0])
    assert got["r0"] == got["again0"]
    started = [e for e in engine.take_events() if isinstance(e, Started)]
    assert [e.reused_tokens for e in started] == [0, 0]


def test_a_long_prompt_in_two_chunks_ends_on_transformers_logits(checkpoints: dict[str, Path]) -> None:
    assert_chunked_prefill_is_transformers(checkpoints["drawn"])


def assert_chunked_prefill_is_transformers(path: Path) -> None:
    """150 positions (three of the delta rule's 64-position chunks) prefilled as 100 then 50, the second chunk
    starting from the first's states: the last position's logits are transformers' (Qwen3.5 holds its family to
    the same)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, COMMON["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(5))
    theirs = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = load_model(path)
    cache = model.make_cache(16, 16)
    table = torch.arange(10, dtype=torch.int32).unsqueeze(0)
    with torch.inference_mode():
        expected = theirs(ids).logits[0, -1]
        model(ids[:, :100], StepBatch.build(torch.arange(100).unsqueeze(0), table), cache)
        got = model(ids[:, 100:], StepBatch.build(torch.arange(100, 150).unsqueeze(0), table), cache)[0, -1]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_state_pools_hold_what_placement_counts_a_torch_stream(checkpoints: dict[str, Path]) -> None:
    """Two bf16 requests decoded side by side: each holds TORCH_STATE_SLOTS slots in every linear layer, whose
    pools (the conv windows in bf16, the recurrent matrices in float32) are then max_batch streams of exactly the
    memory arithmetic's torch figure (LayerMemory.torch_state_bytes, what placement counts a torch rank's stream),
    where the card's state_bytes counts one state (MLX's: its recurrent matrices in float32 too)."""
    from skulk.models.memory_math import TORCH_STATE_SLOTS, model_memory

    path = checkpoints["drawn_bf16"]
    engine = TorchEngine(path, max_batch=2, max_seq=64)
    for i in (0, 1):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    layers = _linear_layers(engine.model)
    held = 0
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
        held = max([held, *(len(v) for layer in layers for v in layer.states.versions.values())])
    assert held == TORCH_STATE_SLOTS
    pools = [(layer.states.conv, layer.states.recurrent) for layer in layers]
    assert all(c is not None and r is not None and c.dtype == torch.bfloat16 and r.dtype == torch.float32
               and c.shape[0] == r.shape[0] == 2 * TORCH_STATE_SLOTS for c, r in pools)
    allocated = sum(c.nbytes + r.nbytes for c, r in pools if c is not None and r is not None)
    memory = model_memory(json.loads((path / "config.json").read_text()))
    assert memory is not None and [layer.kind for layer in memory.layers] == ["linear", "full"] * 2
    counted = sum(layer.torch_state_bytes for layer in memory.layers)
    assert allocated == 2 * counted
    # 2 layers x 2 slots x (4 heads x 16 x 16 float32 + 3 x (2 x 32 + 64) bf16); the card's one state: 9,728
    assert counted == 2 * 2 * (1024 * 4 + 384 * 2) == 19_456
    assert sum(layer.state_bytes for layer in memory.layers) == 2 * (1024 * 4 + 384 * 2) == 9_728


def test_a_set_kv_budget_leaves_room_for_the_streams_states(checkpoints: dict[str, Path]) -> None:
    """Placement's budget for a torch rank counts max_batch streams of states (shard_plan.pool_bytes): the engine
    takes them out before it sizes the block pool, so blocks and states together stay within the budget. Without
    that, the states came on top of a pool that had spent all of it."""
    path = checkpoints["drawn_bf16"]
    probe = TorchEngine(path, max_batch=4, max_seq=64, block_size=4)
    per_stream = probe.model.state_bytes_per_stream()
    layers = _linear_layers(probe.model)
    assert per_stream == sum(layer.states.stream_bytes(torch.bfloat16) for layer in layers) == 19_456
    block_bytes = probe.model.kv_bytes_per_token() * 4
    probe.close()
    budget = 4 * per_stream + 50 * block_bytes + block_bytes // 2
    engine = TorchEngine(path, max_batch=4, max_seq=64, block_size=4, kv_cache_bytes=budget)
    try:
        assert engine.blocks.num_blocks == 50
    finally:
        engine.close()


def test_stream_states_restart_at_zero_and_survive_a_dropped_step() -> None:
    """A step at position 0 reads zeros; a step the engine drops (the same position computed again) reads the
    state before it; a position no step reached is an error, not a silent zero state; forget frees the slots."""
    states = StreamStates((2, 3), (1, 2, 2))
    sources, dests = states.step([7], [0], 4, torch.float32, torch.device("cpu"))
    assert sources == [None]
    states.write(dests, torch.ones(1, 2, 3), torch.ones(1, 1, 2, 2))
    sources, dropped = states.step([7], [4], 1, torch.float32, torch.device("cpu"))
    assert sources == dests
    states.write(dropped, torch.full((1, 2, 3), 5.0), torch.full((1, 1, 2, 2), 5.0))
    again, _ = states.step([7], [4], 3, torch.float32, torch.device("cpu"))  # the chunk the decode row rode beside
    conv, recurrent = states.read(again)
    assert again == dests and float(conv.sum()) == 6 and float(recurrent.sum()) == 4
    with pytest.raises(RuntimeError, match="no linear-attention state at position 9"):
        states.step([7], [9], 1, torch.float32, torch.device("cpu"))
    sources, _ = states.step([7], [0], 2, torch.float32, torch.device("cpu"))
    conv, recurrent = states.read(sources)
    assert sources == [None] and float(conv.abs().sum()) == 0 and float(recurrent.abs().sum()) == 0
    states.forget(7)
    assert states.streams == 0 and len(states.free) == len(set(states.free)) == states.recurrent.shape[0]  # type: ignore[union-attr]


def test_the_catalog_cards_qwen3_next_as_native(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["shared"]
    config = json.loads((path / "config.json").read_text())
    card = card_from_config("Qwen/qwen3-next-tiny", config, (path / "model.safetensors").stat().st_size)
    assert card.torch_runtime == "native" and card.family == "qwen3_next"


MTP_FILE = "model-00002-of-00002.safetensors"


def with_mtp(path: Path, into: Path) -> Path:
    """The checkpoint with the multi-token-prediction block Qwen3-Next's and Qwen3.5's published files carry (vLLM's
    qwen3_next_mtp.py reads it; transformers and mlx-lm drop it): mtp.fc [hidden, 2 x hidden], the norms
    mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and mtp.norm, and mtp.layers.0 a full-attention layer shaped
    as the last decoder layer, every value drawn afresh; in a shard of its own (MTP_FILE) beside the model's, both
    named by the index; the config says mtp_num_hidden_layers 1 (in text_config where it has one)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, into)
    tensors = load_file(str(into / "model.safetensors"))
    config = json.loads((into / "config.json").read_text())
    text = config.get("text_config", config)
    n, h = text["num_hidden_layers"], text["hidden_size"]
    last = next(f"{p}layers.{n - 1}." for p in ("model.language_model.", "model.")
                if any(k.startswith(f"{p}layers.{n - 1}.") for k in tensors))
    g = torch.Generator().manual_seed(3)
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g),
           **{f"mtp.{norm}.weight": torch.randn(h, generator=g)
              for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
           **{"mtp.layers.0." + k.removeprefix(last): torch.randn(v.shape, generator=g).to(v.dtype)
              for k, v in tensors.items() if k.startswith(last)}}
    main = "model-00001-of-00002.safetensors"
    (into / "model.safetensors").rename(into / main)
    save_file(mtp, str(into / MTP_FILE), metadata={"format": "pt"})
    weight_map = dict.fromkeys(tensors, main) | dict.fromkeys(mtp, MTP_FILE)
    (into / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text["mtp_num_hidden_layers"] = 1
    (into / "config.json").write_text(json.dumps(config))
    return into


def _held(model: torch.nn.Module) -> dict[str, int]:
    return {name: t.nbytes for name, t in model.state_dict().items()}


def assert_mtp_block_neither_loaded_nor_staged(path: Path, into: Path) -> None:
    """An MTP block in the files (with_mtp) changes nothing that runs: transformers' tokens are those without it,
    and the engine's match them on one rank and through pipelines; the engine holds exactly the parameters it holds
    without the block; a pipeline stage staged from the hub (store/files.files_for_shard) downloads no MTP file,
    and loads and runs without it. The memory arithmetic counts the block unrun, byte for byte the file's."""
    from skulk.engines.torch.models import read_args_dir
    from skulk.models.memory_math import checkpoint_tensor_bytes, memory_from_tensors, model_memory
    from skulk.store.files import files_for_shard
    from tests.unit.test_glm4_moe import _staged_tokens
    from tests.unit.test_quantized import logits

    mtp = with_mtp(path, into)
    expected = reference(path)
    assert reference(mtp) == expected
    assert_transformers_tokens(mtp)
    with_block, without = load_model(mtp), load_model(path)
    assert _held(with_block) == _held(without)
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(logits(with_block, ids), logits(without, ids))

    index = json.loads((mtp / "model.safetensors.index.json").read_text())
    files = {p.name: p.stat().st_size for p in mtp.iterdir()}
    layers = read_args_dir(mtp).num_hidden_layers
    stages = []
    for start, end in ((0, 2), (2, layers)):
        staged = into.parent / f"{into.name}-stage-{start}"
        staged.mkdir()
        for name in files_for_shard(files, index, (start, end, layers)):
            (staged / name).write_bytes((mtp / name).read_bytes())
        assert MTP_FILE not in {p.name for p in staged.iterdir()}
        stages.append(load_model(staged, start_layer=start, end_layer=end))
    piped = {f"r{i}": _staged_tokens(stages, prompt) for i, prompt in enumerate(PROMPTS)}
    assert (why := disagreement(piped, expected)) is None, f"staged pipeline: {why}"

    config = json.loads((mtp / "config.json").read_text())
    sizes = checkpoint_tensor_bytes(mtp)
    arithmetic, real = model_memory(config), memory_from_tensors(config, sizes)
    assert arithmetic is not None and real is not None
    in_file = sum(b for name, b in sizes.items() if name.startswith("mtp."))
    assert arithmetic.unrun_bytes == real.unrun_bytes == in_file > 0
    assert [layer.weight_bytes for layer in arithmetic.layers] == [layer.weight_bytes for layer in real.layers]


def test_an_mtp_block_in_the_files_is_neither_loaded_nor_staged(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-Next's MTP block, its experts one tensor each as its files keep them; engines/footprint counts a rank
    no byte of it."""
    from skulk.engines.footprint import shard_bytes

    path = checkpoints["drawn"]
    mtp = tmp_path / "mtp"
    assert_mtp_block_neither_loaded_nor_staged(path, mtp)
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in json.loads(
        (mtp / "model.safetensors.index.json").read_text())["weight_map"]
    for start, end in ((0, 2), (2, 4), (0, 4)):
        assert shard_bytes(mtp, start, end) == shard_bytes(path, start, end)


def test_the_fallbacks_decoder_prefix_is_not_the_mtp_blocks(tmp_path: Path) -> None:
    """A shard holding only the MTP block that sorts before the decoder's: the transformers fallback's stages still
    read the decoder under model. (mtp.layers.0 is no decoder layer)."""
    from safetensors.torch import save_file

    from skulk.engines.torch.fallback_stage import checkpoint_prefix

    save_file({"mtp.layers.0.mlp.gate.weight": torch.zeros(2, 2)}, str(tmp_path / "a-mtp.safetensors"))
    save_file({"model.layers.0.mlp.gate.weight": torch.zeros(2, 2)}, str(tmp_path / "b-model.safetensors"))
    assert checkpoint_prefix(tmp_path, torch.nn.Module) == "model."

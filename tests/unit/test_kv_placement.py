"""The KV pool and the context are decided at placement (issue 32): pure units over placement's arithmetic.

The card is test_placement's small model: 8 layers, 2 KV heads of 16, bf16, so one token position costs 128 bytes
per layer (1024 for the whole model) and its 16-token context 16 KiB."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from skulk.engines.footprint import resident_bound
from skulk.engines.kv_pools import DEFAULT_KV_FRACTION
from skulk.master.placement import place, preview_placements
from skulk.master.reconcile import with_committed
from skulk.master.shard_plan import (
    MAX_STREAMS,
    kv_bytes_per_token,
)
from skulk.runner.admission import admit
from skulk.state.desired import desired_of
from skulk.state.queries import served_context
from skulk.types.chat import SamplingParams
from skulk.types.ids import InstanceId, MetaInstanceId, ModelId, NodeId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.memory import GB
from skulk.types.meta_instances import MetaInstance
from skulk.types.models import ModelCard
from skulk.types.placement import InsufficientMemory, KvPoolTooSmall, KvSizing, PlacementError
from skulk.types.runners import RunnerReady
from skulk.types.state import State

from .test_placement import WEIGHTS, card, runner_ids, state

PER_TOKEN = 2 * 8 * 2 * 16 * 2  # keys and values, 8 layers, 2 KV heads of 16, bf16
BASE = resident_bound(WEIGHTS)


def put(s: State, c: ModelCard | None = None, sharding: Sharding = Sharding.Pipeline, *, min_nodes: int = 1,
        **sizing: object) -> MlxRingInstance | PlacementError:
    return place(s, c or card(), sharding, InstanceMeta.MlxRing, instance_id=InstanceId("inst-1"),
                 new_runner_id=runner_ids(), rendezvous_port=29500, min_nodes=min_nodes,
                 sizing=KvSizing.model_validate(sizing))


def placed(result: MlxRingInstance | PlacementError) -> MlxRingInstance:
    assert isinstance(result, MlxRingInstance), getattr(result, "message", result)
    return result


def pools(instance: MlxRingInstance) -> list[int]:
    """Each rank's pool, in rank order."""
    shards = instance.shard_assignments.runner_to_shard
    return [instance.kv_cache_bytes[r] for r in sorted(shards, key=lambda r: shards[r].device_rank)]


def test_per_token_cost_is_the_models_kv_size() -> None:
    assert kv_bytes_per_token(card(), 8) == PER_TOKEN
    assert kv_bytes_per_token(card(), 2) == PER_TOKEN // 4
    assert kv_bytes_per_token(card(), 8, tensor_ways=2) == PER_TOKEN // 2
    assert kv_bytes_per_token(card(tasks=["TextEmbedding"]), 8) == 0


def test_the_default_pool_is_a_share_of_what_is_left_after_the_weights() -> None:
    c = card(context_length=4096)  # 64 whole contexts would be 256 MiB: the fraction decides
    free = BASE + 64 * 1024 * 1024
    instance = placed(put(state({"a": free}), c))
    tokens = int(DEFAULT_KV_FRACTION * (free - BASE)) // PER_TOKEN
    assert pools(instance) == [tokens * PER_TOKEN]
    assert instance.context_length == 4096


def test_the_default_pool_never_exceeds_max_streams_whole_contexts() -> None:
    instance = placed(put(state({"a": 1 << 40}), card()))
    assert pools(instance) == [MAX_STREAMS * 16 * PER_TOKEN]


def test_the_default_pool_holds_at_least_one_whole_context_and_the_fit_check_counts_it() -> None:
    c = card()
    one_context = 16 * PER_TOKEN
    fits = placed(put(state({"a": BASE + one_context + 1}), c))
    assert pools(fits) == [one_context]
    refused = put(state({"a": BASE + one_context}), c)
    assert isinstance(refused, InsufficientMemory)
    assert refused.kv_pool.in_bytes == one_context and refused.needed.in_bytes == BASE + one_context
    assert "KV pool" in refused.message and "kv_cache_gb or max_context" in refused.message


def test_pipeline_ranks_hold_the_same_positions_of_their_own_layers() -> None:
    kv = 1 << 20  # 1 MiB for the instance: 1024 positions of every layer
    instance = placed(put(state({"a": 2 << 30, "b": 1 << 30}), card(), min_nodes=2, kv_cache_gb=kv / GB))
    shards = instance.shard_assignments.runner_to_shard
    layers = [shards[r].end_layer - shards[r].start_layer for r in sorted(shards, key=lambda r: shards[r].device_rank)]
    assert layers != [4, 4]  # proportional to free memory, so the ranks' pools differ
    assert pools(instance) == [1024 * n * PER_TOKEN // 8 for n in layers]
    assert sum(pools(instance)) == kv


def test_tensor_ranks_hold_their_heads_share() -> None:
    kv = 1 << 20
    instance = placed(put(state({"a": 1 << 30, "b": 1 << 30}), card(), Sharding.Tensor, min_nodes=2,
                          kv_cache_gb=kv / GB))
    assert pools(instance) == [kv // 2, kv // 2]


def test_the_default_pool_is_sized_by_the_tightest_rank() -> None:
    free = {"a": BASE + (8 << 20), "b": 1 << 40}
    instance = placed(put(state(free), card(context_length=4096), Sharding.Tensor, min_nodes=2))
    tokens = int(DEFAULT_KV_FRACTION * (free["a"] - resident_bound(-(-WEIGHTS // 2)))) \
        // (PER_TOKEN // 2)
    assert pools(instance) == [tokens * PER_TOKEN // 2] * 2


def test_an_explicit_pool_that_does_not_fit_beside_the_weights_is_refused_saying_so() -> None:
    result = put(state({"a": BASE + (1 << 20)}), card(), kv_cache_gb=2 / 1024)  # 2 MiB pool, 1 MiB spare
    assert isinstance(result, InsufficientMemory)
    assert result.kv_pool.in_bytes == 2 << 20
    assert "KV pool) but has" in result.message
    assert result.code == "InsufficientMemory" and result.http_status == 400


def test_a_pool_smaller_than_one_context_is_a_typed_refusal_naming_both_ways_out() -> None:
    c = card(context_length=4096)
    result = put(state({"a": 1 << 40}), c, kv_cache_gb=(1000 * PER_TOKEN) / GB)
    assert isinstance(result, KvPoolTooSmall)
    assert (result.pool_tokens, result.context_length, result.http_status) == (1000, 4096, 400)
    assert result.least.in_bytes == 4096 * PER_TOKEN
    assert "max_context to at most 1000" in result.message and "Raise kv_cache_gb" in result.message
    previews = preview_placements(state({"a": 1 << 40}), c, Sharding.Pipeline, InstanceMeta.MlxRing,
                                  sizing=KvSizing(kv_cache_gb=(1000 * PER_TOKEN) / GB))
    assert previews and all(isinstance(p.error, KvPoolTooSmall) for p in previews)
    fits = placed(put(state({"a": 1 << 40}), c, kv_cache_gb=(1000 * PER_TOKEN) / GB, max_context=1000))
    assert fits.context_length == 1000 and pools(fits) == [1000 * PER_TOKEN]


def test_the_cards_kv_cache_gb_is_the_default_and_the_placement_overrides_it() -> None:
    c = card(kv_cache_gb=(512 * PER_TOKEN) / GB)
    assert pools(placed(put(state({"a": 1 << 40}), c))) == [512 * PER_TOKEN]
    assert pools(placed(put(state({"a": 1 << 40}), c, kv_cache_gb=(64 * PER_TOKEN) / GB))) == [64 * PER_TOKEN]


@pytest.mark.parametrize(("max_context", "admitted"), [(None, 16), (10, 10), (16, 16), (1000, 16)])
def test_max_context_is_capped_by_the_models_own(max_context: int | None, admitted: int) -> None:
    instance = placed(put(state({"a": 1 << 40}), card(), max_context=max_context))
    assert instance.context_length == instance.admits == admitted
    assert pools(instance) == [MAX_STREAMS * admitted * PER_TOKEN]  # a smaller context needs a smaller pool
    (preview,) = preview_placements(state({"a": 1 << 40}), card(), Sharding.Pipeline, InstanceMeta.MlxRing,
                                    sizing=KvSizing(max_context=max_context))
    assert preview.context_length == admitted
    assert preview.nodes[0].kv_pool.in_bytes == pools(instance)[0]
    assert preview.nodes[0].needed.in_bytes == BASE + pools(instance)[0]


def test_an_embedding_model_keeps_its_own_context_and_no_pool() -> None:
    instance = placed(put(state({"a": 1 << 40}), card(tasks=["TextEmbedding"]), max_context=8, kv_cache_gb=1.0))
    assert (instance.context_length, instance.kv_cache_bytes) == (16, {})


def test_sizing_is_validated() -> None:
    for bad in ({"kv_cache_gb": 0}, {"kv_cache_gb": -1}, {"max_context": 1}, {"max_context": 0}):
        with pytest.raises(ValidationError):
            KvSizing.model_validate(bad)
    with pytest.raises(ValidationError):
        MetaInstance(meta_instance_id=MetaInstanceId("m"), model_id=ModelId("test/model"), max_context=1)


def test_an_instance_without_the_fields_admits_the_models_own_context() -> None:
    instance = placed(put(state({"a": 1 << 40}), card()))
    legacy = instance.model_copy(update={"context_length": None, "kv_cache_bytes": {}})
    assert legacy.admits == 16


def test_committed_pools_are_subtracted_loaded_or_not() -> None:
    s = state({"a": 1 << 30})
    instance = placed(put(s, card(), kv_cache_gb=(1 << 20) / GB))
    (runner,) = instance.shard_assignments.runner_to_shard
    s = s.model_copy(update={"instances": {instance.instance_id: instance}})
    loading = with_committed(s).node_memory[NodeId("a")].ram_available.in_bytes
    assert loading == (1 << 30) - WEIGHTS - (1 << 20)
    loaded = s.model_copy(update={"runners": {runner: RunnerReady()}})
    assert with_committed(loaded).node_memory[NodeId("a")].ram_available.in_bytes == (1 << 30) - (1 << 20)


def test_served_context_is_what_the_placed_instances_admit() -> None:
    c = card(context_length=4096)
    s = state({"a": 1 << 40})
    assert served_context(s, c) == 4096
    one = placed(put(s, c, max_context=1000))
    two = placed(put(s, c, max_context=3000)).model_copy(update={"instance_id": InstanceId("inst-2")})
    with_one = s.model_copy(update={"instances": {one.instance_id: one}})
    assert served_context(with_one, c) == 1000
    with_both = s.model_copy(update={"instances": {one.instance_id: one, two.instance_id: two}})
    assert served_context(with_both, c) == 1000  # every instance a request may reach admits it
    assert served_context(with_one, card(model_id=ModelId("test/other"))) == 16


def test_a_restart_keeps_the_meta_instances_sizing() -> None:
    meta = MetaInstance(meta_instance_id=MetaInstanceId("m"), model_id=ModelId("test/model"), kv_cache_gb=1.5,
                        max_context=512, placement_error="old")
    kept = desired_of(State(meta_instances={meta.meta_instance_id: meta})).meta_instances[meta.meta_instance_id]
    assert (kept.kv_cache_gb, kept.max_context, kept.placement_error) == (1.5, 512, None)
    assert kept.sizing == KvSizing(kv_cache_gb=1.5, max_context=512)


def test_placements_defaults_are_the_engines() -> None:
    """Placement never imports the engine (torch); the streams constant it mirrors must stay equal (the KV share
    has one home both read, kv_pools.DEFAULT_KV_FRACTION)."""
    from skulk.engines.torch.engine import DEFAULT_MAX_BATCH

    assert MAX_STREAMS == DEFAULT_MAX_BATCH


def test_the_instance_carries_its_sizing_over_the_wire() -> None:
    instance = placed(put(state({"a": 1 << 40}), card(), kv_cache_gb=(1 << 20) / GB, max_context=8))
    wire = instance.model_dump(mode="json", by_alias=True)
    body = wire["MlxRingInstance"]
    assert body["contextLength"] == 8 and list(body["kvCacheBytes"].values()) == [1 << 20]
    assert MlxRingInstance.model_validate(wire) == instance


def test_the_runner_holds_a_request_to_the_advertised_context() -> None:
    """A request carries the context the API advertised; an instance with more admits and generates no more."""
    implicit, explicit = SamplingParams(max_tokens=256), SamplingParams(max_tokens=8, max_tokens_explicit=True)
    assert admit(199, implicit, 300, 200) == (None, implicit.model_copy(update={"max_tokens": 1}))
    refused, _ = admit(200, implicit, 300, 200)
    assert refused is not None and "maximum context length is 200 tokens" in refused
    assert admit(192, explicit, 300, 200) == (None, explicit)
    refused, _ = admit(193, explicit, 300, 200)
    assert refused is not None and "maximum context length is 200 tokens" in refused
    assert admit(250, implicit, 300, None)[0] is None  # no limit: the engine's own context
    assert admit(100, implicit, 300, 1000) == (None, implicit)  # a limit above the engine's changes nothing

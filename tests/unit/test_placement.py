"""Placement: per-node memory (never summed), rings, layer splits, typed refusals, previews."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping

import pytest
from pydantic import TypeAdapter

from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES, resident_bound
from skulk.master.cycles import find_ring
from skulk.master.placement import (
    allocate_layers,
    kv_headroom_bytes,
    place,
    preview_placements,
)
from skulk.types.ids import InstanceId, ModelId, NodeId, RunnerId
from skulk.types.instances import InstanceMeta, MlxRingInstance, Sharding
from skulk.types.memory import Memory
from skulk.types.models import ModelCard
from skulk.types.node_info import Connection, MemoryUsage, NodeIdentity, Topology
from skulk.types.placement import (
    AllCandidatesExcluded,
    AnyPlacementError,
    InfoPending,
    InstanceKindUnsupported,
    InsufficientMemory,
    NoConnectedCycle,
    NotEnoughLayers,
    PlacementError,
    PlacementPreview,
    TensorNotSupported,
)
from skulk.types.shards import PipelineShardMetadata, TensorShardMetadata
from skulk.types.state import State

WEIGHTS = 8 * 1024 * 1024
N_LAYERS = 8


def card(**overrides: object) -> ModelCard:
    """A small model: head_dim 16, 2 KV heads, 16-token context, bf16 -> 2048 KV bytes per layer."""
    fields: dict[str, object] = {
        "model_id": ModelId("test/model"),
        "family": "llama",
        "n_layers": N_LAYERS,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "storage_size": Memory.from_bytes(WEIGHTS),
        "context_length": 16,
        "mlx_splits": ["Pipeline", "Tensor"],  # mlx-lm's llama, as the catalog cards it
    }
    fields.update(overrides)
    return ModelCard.model_validate(fields)


def needed_whole(c: ModelCard) -> int:
    """What one node needs for the whole model: the number the exactly-equal test pivots on."""
    return resident_bound(c.storage_size.in_bytes) + kv_headroom_bytes(c, c.n_layers)


def layers_need(c: ModelCard) -> int:
    """What the whole model needs beside the runner every rank pays (RUNTIME_OVERHEAD_BYTES): the part that a
    split divides."""
    return needed_whole(c) - RUNTIME_OVERHEAD_BYTES


def beside_runner(nbytes: int) -> int:
    """Free memory that leaves `nbytes` once a rank's runner is counted."""
    return nbytes + RUNTIME_OVERHEAD_BYTES


def addr(node: str) -> str:
    return f"10.0.0.{ord(node[-1]) - ord('a') + 1}"


def state(
    memory: Mapping[str, int | None],
    edges: Iterable[tuple[str, str]] | None = None,
) -> State:
    """Nodes with free memory (None = not reported yet); edges default to every pair both ways."""
    nodes = [NodeId(n) for n in memory]
    pairs = list(itertools.permutations(nodes, 2)) if edges is None else list(edges)
    return State(
        topology=Topology(
            nodes=nodes,
            connections=[
                Connection(source=NodeId(a), sink=NodeId(b), sink_address=addr(b)) for a, b in pairs
            ],
        ),
        node_memory={
            NodeId(n): MemoryUsage(
                ram_total=Memory.from_bytes(free * 2), ram_available=Memory.from_bytes(free)
            )
            for n, free in memory.items()
            if free is not None
        },
    )


def runner_ids() -> Callable[[], RunnerId]:
    counter = itertools.count()
    return lambda: RunnerId(f"runner-{next(counter)}")


def do_place(
    s: State,
    c: ModelCard | None = None,
    sharding: Sharding = Sharding.Pipeline,
    meta: InstanceMeta = InstanceMeta.MlxRing,
    *,
    min_nodes: int = 1,
    excluded_nodes: Iterable[NodeId] = (),
) -> MlxRingInstance | PlacementError:
    return place(
        s,
        c or card(),
        sharding,
        meta,
        instance_id=InstanceId("inst-1"),
        new_runner_id=runner_ids(),
        rendezvous_port=29500,
        min_nodes=min_nodes,
        excluded_nodes=excluded_nodes,
    )


def placed(result: MlxRingInstance | PlacementError) -> MlxRingInstance:
    assert isinstance(result, MlxRingInstance), getattr(result, "message", result)
    return result


def nodes_in_rank_order(instance: MlxRingInstance) -> list[NodeId]:
    a = instance.shard_assignments
    by_runner = {r: n for n, r in a.node_to_runner.items()}
    return [by_runner[r] for r, _ in sorted(a.runner_to_shard.items(), key=lambda kv: kv[1].device_rank)]


# --------------------------------------------------------------------------------------- memory


def test_exactly_equal_memory_is_refused() -> None:
    c = card()
    result = do_place(state({"a": needed_whole(c)}), c)
    assert isinstance(result, InsufficientMemory)
    assert result.node_id == "a"
    assert result.needed.in_bytes == result.available.in_bytes == needed_whole(c)
    assert result.http_status == 400


def test_one_byte_more_than_needed_is_accepted() -> None:
    c = card()
    instance = placed(do_place(state({"a": needed_whole(c) + 1}), c))
    assert nodes_in_rank_order(instance) == ["a"]


def test_insufficient_memory_message_shows_the_gb_arithmetic() -> None:
    c = card(
        storage_size=Memory.from_gb(1.4),
        n_layers=1,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        context_length=39322,
    )  # KV: 2*1*8*128*39322*2 bytes = 0.15 GB
    result = do_place(state({"x": Memory.from_gb(1.5).in_bytes}), c)
    assert isinstance(result, InsufficientMemory)
    assert result.message.startswith(
        "node x needs 2.18 GB (1.40 GB weights share × 1.05 + 0.56 GB runtime + 0.15 GB KV pool) but has 1.50 GB "  # noqa: RUF001
        "free"
    )
    assert "free memory on node x" in result.message


def test_memory_is_checked_per_node_not_summed_pipeline() -> None:
    """a + b together exceed the whole model's need, but b cannot hold even one layer."""
    c = card()
    whole = needed_whole(c)
    one_layer = resident_bound(WEIGHTS // N_LAYERS) + kv_headroom_bytes(c, 1)
    s = state({"a": whole - 1, "b": one_layer // 2})
    assert (whole - 1) + one_layer // 2 > whole
    result = do_place(s, c, min_nodes=2)
    assert isinstance(result, InsufficientMemory)
    assert result.node_id == "b"
    assert result.node_ids == ["a", "b"]


def test_pipeline_accepts_two_nodes_whose_shares_fit_though_neither_holds_the_model() -> None:
    c = card()
    free = beside_runner(layers_need(c) * 6 // 10)
    instance = placed(do_place(state({"a": free, "b": free}), c))
    assert sorted(nodes_in_rank_order(instance)) == ["a", "b"]


def test_tensor_refuses_when_one_node_cannot_hold_half_though_the_sum_is_enough() -> None:
    c = card()
    whole = needed_whole(c)
    result = do_place(state({"a": whole - 1, "b": whole // 3}), c, Sharding.Tensor, min_nodes=2)
    assert isinstance(result, InsufficientMemory)
    assert result.node_id == "b"
    assert result.weights_share.in_bytes == WEIGHTS // 2


# ----------------------------------------------------------------------------------------- layers


def test_pipeline_layers_follow_free_memory_proportions() -> None:
    unit = layers_need(card())
    free = {"a": beside_runner(unit // 2), "b": beside_runner(unit), "c": beside_runner(unit // 2)}
    instance = placed(do_place(state(free), card(), min_nodes=3))
    layers = {
        n: instance.shard_assignments.runner_to_shard[r].end_layer
        - instance.shard_assignments.runner_to_shard[r].start_layer
        for n, r in instance.shard_assignments.node_to_runner.items()
    }
    assert layers == {"a": 2, "b": 4, "c": 2}


@pytest.mark.parametrize(
    ("n_layers", "free", "expected"),
    [
        (10, [1, 1, 1], [4, 3, 3]),  # largest remainder, ties to the lower rank
        (4, [100, 1, 1], [2, 1, 1]),  # every rank gets at least one layer
        (8, [1, 2, 1], [2, 4, 2]),
        (3, [0, 0, 0], [1, 1, 1]),
        (7, [3, 4], [3, 4]),
    ],
)
def test_allocate_layers(n_layers: int, free: list[int], expected: list[int]) -> None:
    assert allocate_layers(n_layers, free) == expected
    assert sum(expected) == n_layers


def test_pipeline_shards_are_contiguous_and_cover_every_layer_once() -> None:
    unit = layers_need(card())
    s = state({n: beside_runner(unit // k) for n, k in (("a", 3), ("b", 2), ("c", 5), ("d", 1))})
    instance = placed(do_place(s, card(), min_nodes=4))
    shards = sorted(instance.shard_assignments.runner_to_shard.values(), key=lambda sh: sh.device_rank)
    assert [sh.device_rank for sh in shards] == [0, 1, 2, 3]
    assert all(isinstance(sh, PipelineShardMetadata) for sh in shards)
    assert all(sh.world_size == 4 and sh.n_layers == N_LAYERS for sh in shards)
    assert shards[0].start_layer == 0 and shards[-1].end_layer == N_LAYERS
    assert all(prev.end_layer == nxt.start_layer for prev, nxt in itertools.pairwise(shards))
    assert all(sh.end_layer > sh.start_layer for sh in shards)
    assert instance.sharding == Sharding.Pipeline and instance.engine == "torch"


def test_tensor_shards_own_every_layer() -> None:
    unit = needed_whole(card())
    instance = placed(do_place(state({"a": unit, "b": unit}), card(), Sharding.Tensor, min_nodes=2))
    shards = list(instance.shard_assignments.runner_to_shard.values())
    assert all(isinstance(sh, TensorShardMetadata) for sh in shards)
    assert {(sh.start_layer, sh.end_layer, sh.world_size) for sh in shards} == {(0, N_LAYERS, 2)}
    assert sorted(sh.device_rank for sh in shards) == [0, 1]


def test_pipeline_refuses_more_nodes_than_layers() -> None:
    unit = needed_whole(card())
    result = do_place(state({"a": unit, "b": unit, "c": unit}), card(n_layers=2), min_nodes=3)
    assert isinstance(result, NotEnoughLayers)


# ------------------------------------------------------------------------------------------ tensor


def test_tensor_refused_when_heads_not_divisible_by_node_count() -> None:
    unit = needed_whole(card())
    result = do_place(state({"a": unit, "b": unit, "c": unit}), card(), Sharding.Tensor, min_nodes=3)
    assert isinstance(result, TensorNotSupported)
    assert result.reason == "attention_heads_not_divisible"
    assert result.node_count == 3
    assert "divisible by 3" in result.message


def test_tensor_refused_when_kv_heads_not_divisible() -> None:
    unit = needed_whole(card())
    c = card(num_attention_heads=4, num_key_value_heads=1)
    result = do_place(state({"a": unit, "b": unit}), c, Sharding.Tensor, min_nodes=2)
    assert isinstance(result, TensorNotSupported)
    assert result.reason == "kv_heads_not_divisible"


def test_tensor_refused_when_model_does_not_support_it() -> None:
    result = do_place(state({"a": needed_whole(card()) * 2}), card(supports_tensor=False), Sharding.Tensor)
    assert isinstance(result, TensorNotSupported)
    assert result.reason == "model_unsupported"
    assert result.http_status == 400


# ----------------------------------------------------------------------------- topology and kinds


def test_exclusions_removing_every_candidate() -> None:
    unit = needed_whole(card()) * 2
    result = do_place(state({"a": unit, "b": unit}), excluded_nodes=[NodeId("a"), NodeId("b")])
    assert isinstance(result, AllCandidatesExcluded)
    assert result.excluded_node_ids == ["a", "b"]
    assert "GET /state" in result.message


def test_excluded_node_is_never_used_and_unknown_ids_are_ignored() -> None:
    unit = needed_whole(card()) * 2
    s = state({"a": unit, "b": unit})
    instance = placed(do_place(s, excluded_nodes=[NodeId("a"), NodeId("gone")]))
    assert nodes_in_rank_order(instance) == ["b"]


def test_no_cycle_of_min_nodes() -> None:
    unit = needed_whole(card())
    s = state({"a": unit, "b": unit, "c": unit}, edges=[("a", "b"), ("b", "a"), ("b", "c")])
    result = do_place(s, min_nodes=3)
    assert isinstance(result, NoConnectedCycle)
    assert (result.min_nodes, result.connected_nodes, result.available_nodes) == (3, 2, 3)
    assert result.http_status == 400


def test_one_way_edge_is_not_a_two_node_cycle() -> None:
    unit = needed_whole(card())
    result = do_place(state({"a": unit, "b": unit}, edges=[("a", "b")]), min_nodes=2)
    assert isinstance(result, NoConnectedCycle)
    assert result.connected_nodes == 1


def test_directed_three_node_ring_is_a_cycle() -> None:
    unit = needed_whole(card())
    s = state({"a": unit, "b": unit, "c": unit}, edges=[("a", "b"), ("b", "c"), ("c", "a")])
    instance = placed(do_place(s, min_nodes=3))
    assert nodes_in_rank_order(instance) == ["a", "b", "c"]
    # b cannot reach a directly, so the ranks meet rank 0 where the ring's closing edge reaches it
    assert instance.rendezvous is not None and instance.rendezvous.host == addr("a")


def test_missing_memory_info_is_pending_not_insufficient() -> None:
    c = card()
    s = state({"a": needed_whole(c) // 2, "b": None})
    result = do_place(s, c)
    assert isinstance(result, InfoPending)
    assert result.node_ids == ["b"]
    assert result.http_status == 503


def test_mlx_jaccl_is_refused() -> None:
    result = do_place(state({"a": needed_whole(card()) * 2}), meta=InstanceMeta.MlxJaccl)
    assert isinstance(result, InstanceKindUnsupported)
    assert "MlxRing" in result.message


# --------------------------------------------------------------------------------------- choice


def test_fewest_nodes_then_most_headroom_then_ids() -> None:
    whole = needed_whole(card())
    s = state({"a": whole * 6 // 10, "b": whole * 6 // 10, "c": whole + 10, "d": whole + 20})
    assert nodes_in_rank_order(placed(do_place(s))) == ["d"]
    assert sorted(nodes_in_rank_order(placed(do_place(s, min_nodes=2)))) == ["c", "d"]
    tie = state({"b": whole * 2, "a": whole * 2})
    assert nodes_in_rank_order(placed(do_place(tie))) == ["a"]


def test_runner_ids_and_rank_order_in_assignments() -> None:
    unit = needed_whole(card())
    instance = placed(do_place(state({"b": unit, "a": unit}), min_nodes=2))
    assert instance.shard_assignments.node_to_runner == {"a": "runner-0", "b": "runner-1"}
    assert instance.instance_id == "inst-1" and instance.world_size == 2


# ---------------------------------------------------------------------------------- rendezvous


def test_rendezvous_host_is_where_rank_one_reaches_rank_zero() -> None:
    unit = needed_whole(card())
    s = state({"a": unit, "b": unit})
    s = s.model_copy(
        update={
            "topology": Topology(
                nodes=s.topology.nodes,
                connections=[
                    Connection(source=NodeId("a"), sink=NodeId("b"), sink_address="192.168.1.20"),
                    Connection(source=NodeId("b"), sink=NodeId("a"), sink_address="192.168.1.10"),
                ],
            )
        }
    )
    instance = placed(do_place(s, min_nodes=2))
    assert nodes_in_rank_order(instance)[:2] == ["a", "b"]
    assert instance.rendezvous is not None
    assert (instance.rendezvous.host, instance.rendezvous.port) == ("192.168.1.10", 29500)


def test_single_node_rendezvous_is_loopback() -> None:
    instance = placed(do_place(state({"a": needed_whole(card()) * 2})))
    assert instance.rendezvous is not None and instance.rendezvous.host == "127.0.0.1"


def test_find_ring_prefers_an_order_where_rank_one_reaches_rank_zero() -> None:
    edges = [("a", "b"), ("b", "c"), ("c", "d"), ("d", "a"), ("a", "c"), ("c", "b"), ("b", "d"), ("c", "a")]
    adj = {NodeId(n): frozenset(NodeId(y) for x, y in edges if x == n) for n in "abcd"}
    members = [NodeId(n) for n in "abcd"]
    # a-b-c-d-a comes first but b cannot reach a; a-c-b-d-a closes too and c reaches a directly
    assert find_ring(members, adj) == ("a", "c", "b", "d")
    one_way = {NodeId(n): frozenset({NodeId(m)}) for n, m in zip("abcd", "bcda", strict=True)}
    assert find_ring(members, one_way) == ("a", "b", "c", "d")
    assert find_ring(members[:3], one_way) is None


# -------------------------------------------------------------------------------------- previews


def test_previews_list_every_combination() -> None:
    whole = needed_whole(card())
    half = beside_runner(layers_need(card()) // 2)
    s = state({"a": whole + 1, "b": half, "c": half})
    previews = preview_placements(s, card(), Sharding.Pipeline, InstanceMeta.MlxRing, excluded_nodes=[])
    assert [p.node_ids for p in previews] == [
        ["a"],
        ["b"],
        ["c"],
        ["a", "b"],
        ["a", "c"],
        ["b", "c"],
        ["a", "b", "c"],
    ]
    ok = {tuple(p.node_ids) for p in previews if p.ok}
    # b+c: half the layers each need exactly half of `whole`, which equals their free memory: refused
    assert ok == {("a",), ("a", "b"), ("a", "c"), ("a", "b", "c")}
    single_a = previews[0]
    node = single_a.nodes[0]
    assert node.needed.in_bytes == whole
    assert node.free.in_bytes == whole + 1
    assert node.left_after.in_bytes == 1
    assert isinstance(previews[1].error, InsufficientMemory) and previews[1].nodes == []


def test_previews_honour_exclusions_and_carry_global_refusals() -> None:
    unit = needed_whole(card())
    s = state({"a": unit, "b": unit, "c": unit})
    previews = preview_placements(s, card(), Sharding.Pipeline, InstanceMeta.MlxRing, [NodeId("c")])
    assert [p.node_ids for p in previews] == [["a"], ["b"], ["a", "b"]]
    refused = preview_placements(s, card(), Sharding.Pipeline, InstanceMeta.MlxJaccl)
    assert len(refused) == 7 and all(isinstance(p.error, InstanceKindUnsupported) for p in refused)


def test_preview_round_trips_as_camel_case_json() -> None:
    s = state({"a": needed_whole(card()) // 2, "b": None})
    previews = preview_placements(s, card(), Sharding.Pipeline, InstanceMeta.MlxRing)
    payload = previews[0].model_dump(mode="json")
    assert set(payload) == {"modelId", "sharding", "instanceMeta", "nodeIds", "nodes", "contextLength", "error"}
    assert "InsufficientMemory" in payload["error"]
    assert PlacementPreview.model_validate(payload) == previews[0]
    last_error = previews[-1].error
    pending = TypeAdapter(AnyPlacementError).validate_python(previews[-1].model_dump()["error"])
    assert isinstance(pending, InfoPending) and pending == last_error


def test_friendly_name_appears_in_the_memory_message() -> None:
    s = state({"a": 10}).model_copy(
        update={"node_identities": {NodeId("a"): NodeIdentity(friendly_name="studio")}}
    )
    result = do_place(s)
    assert isinstance(result, InsufficientMemory)
    assert result.message.startswith("node a (studio) needs")

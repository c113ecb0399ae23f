"""A card's draft model in placement and staging: a single torch rank loads the draft beside the target (its
weights, and its KV for the pool's positions), so placement counts them there; a split or an MLX rank does not
speculate and counts nothing; the draft is a companion staging never evicts while the target runs."""

from __future__ import annotations

import pytest

from skulk.engines.footprint import RUNTIME_OVERHEAD_BYTES, resident_bound
from skulk.master.shard_plan import draft_weights, kv_bytes_per_token, plan_ring
from skulk.store.staging import in_use
from skulk.types.ids import ModelId, NodeId
from skulk.types.instances import Sharding
from skulk.types.memory import Memory
from skulk.types.placement import InsufficientMemory
from tests.unit.test_placement import WEIGHTS, card, do_place, placed, state

pytestmark = pytest.mark.timeout(30)

DRAFT = card(model_id=ModelId("test/draft"), n_layers=2, storage_size=Memory.from_bytes(WEIGHTS // 4))
TARGET = card(draft_model=DRAFT.model_id)
FREE = 64 * 1024 * 1024 + RUNTIME_OVERHEAD_BYTES  # 64 MiB beside the runner


def test_a_single_torch_rank_counts_the_drafts_weights_and_kv() -> None:
    (plain,) = plan_ring(card(), Sharding.Pipeline, [NodeId("a")], [FREE])
    (rank,) = plan_ring(TARGET, Sharding.Pipeline, [NodeId("a")], [FREE], draft=DRAFT)
    tokens = plain.kv_pool // kv_bytes_per_token(TARGET, TARGET.n_layers)
    assert rank.kv_pool == plain.kv_pool  # the target's pool (what the runner is told) is unchanged
    assert rank.draft == draft_weights(DRAFT) + tokens * kv_bytes_per_token(DRAFT, 2) > 0
    assert rank.needed == plain.needed + rank.draft


def test_a_split_or_an_mlx_rank_counts_no_draft() -> None:
    ring = [NodeId("a"), NodeId("b")]
    assert all(p.draft == 0 for p in plan_ring(TARGET, Sharding.Pipeline, ring, [FREE, FREE], draft=DRAFT))
    assert all(p.draft == 0 for p in plan_ring(TARGET, Sharding.Tensor, ring, [FREE, FREE], draft=DRAFT))
    (mlx,) = plan_ring(TARGET, Sharding.Pipeline, [NodeId("a")], [FREE], engines=["mlx"], draft=DRAFT)
    assert mlx.draft == 0


def test_a_node_that_holds_the_target_but_not_its_draft_refuses_it() -> None:
    (alone,) = plan_ring(card(), Sharding.Pipeline, [NodeId("a")], [FREE])
    (both,) = plan_ring(TARGET, Sharding.Pipeline, [NodeId("a")], [FREE], draft=DRAFT)
    between = (alone.needed + both.needed) // 2
    s = state({"a": between})
    s = s.model_copy(update={"model_cards": {DRAFT.model_id: DRAFT}})
    placed(do_place(s, card()))
    refused = do_place(s, TARGET)
    assert isinstance(refused, InsufficientMemory), refused
    assert refused.draft is not None and refused.draft.in_bytes > 0 and "draft model" in refused.message
    assert refused.needed.in_bytes == refused.draft.in_bytes + refused.kv_pool.in_bytes + resident_bound(WEIGHTS)
    placed(do_place(s.model_copy(update={"model_cards": {}}), TARGET))  # a draft the cluster does not know: none


def test_the_draft_is_in_use_while_its_target_runs_here() -> None:
    s = state({"a": FREE})
    s = s.model_copy(update={"instances": {(i := placed(do_place(s, TARGET))).instance_id: i}})
    assert in_use(s, NodeId("a")) == {TARGET.model_id, DRAFT.model_id}
    assert in_use(s, NodeId("b")) == set()


def test_committed_memory_counts_the_draft_until_its_runner_has_loaded_and_its_kv_after() -> None:
    from skulk.master.reconcile import with_committed
    from skulk.types.runners import RunnerLoaded

    s = state({"a": FREE}).model_copy(update={"model_cards": {DRAFT.model_id: DRAFT}})
    plain, drafted = placed(do_place(s, card())), placed(do_place(s, TARGET))
    pool = next(iter(drafted.kv_cache_bytes.values()))
    draft_kv = pool // kv_bytes_per_token(TARGET, TARGET.n_layers) * kv_bytes_per_token(DRAFT, DRAFT.n_layers)

    def free_after(instance: object, loaded: bool) -> int:
        runner = next(iter(drafted.kv_cache_bytes))
        runners = {runner: RunnerLoaded()} if loaded else {}
        committed = with_committed(s.model_copy(update={"instances": {drafted.instance_id: instance},
                                                        "runners": runners}))
        return committed.node_memory[NodeId("a")].ram_available.in_bytes

    assert free_after(plain, False) - free_after(drafted, False) == WEIGHTS // 4 + draft_kv
    assert free_after(plain, True) - free_after(drafted, True) == draft_kv

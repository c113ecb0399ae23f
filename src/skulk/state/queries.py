"""Questions about state that more than one layer asks (the master when it picks an instance, the worker when
it hands a task to its runners): answered once here."""

from __future__ import annotations

from skulk.models.cards import get_card
from skulk.types.ids import ModelId
from skulk.types.instances import MlxRingInstance
from skulk.types.models import ModelCard
from skulk.types.runners import RunnerReady, RunnerRunning
from skulk.types.state import State


def card_of(state: State, model_id: str) -> ModelCard | None:
    """A model's card, the one lookup every layer uses: the packaged catalog's (with the custom cards this node
    loaded or learned), else one a node added to the cluster (POST /models/add, an import), which the state
    carries."""
    return get_card(model_id) or state.model_cards.get(ModelId(model_id))


def is_serving(state: State, instance: MlxRingInstance) -> bool:
    """Every rank of the instance is ready or running: only then can a task reach all of them."""
    return all(isinstance(state.runners.get(r), RunnerReady | RunnerRunning)
               for r in instance.shard_assignments.runner_to_shard)


def served_context(state: State, card: ModelCard) -> int:
    """The context every API surface advertises for a model (/models, /v1/models, Ollama show/ps, the dashboard,
    count_tokens): what its placed instances admit, the smallest when their max_context differ (a request may
    reach any of them), or the model's own while none is placed. The runners admit by the same number."""
    placed = [i.admits for i in state.instances.values() if i.model_id == card.model_id]
    return min(placed) if placed else card.context_length

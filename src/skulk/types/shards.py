"""Which slice of a model one runner owns."""

from __future__ import annotations

from typing import Annotated

from pydantic import Discriminator, Tag

from .base import TaggedModel, tag_of
from .models import ModelCard


class _ShardFields(TaggedModel):
    model_card: ModelCard
    device_rank: int
    world_size: int
    start_layer: int
    end_layer: int
    n_layers: int

    @property
    def is_first(self) -> bool:
        return self.device_rank == 0

    @property
    def is_last(self) -> bool:
        return self.device_rank == self.world_size - 1


class PipelineShardMetadata(_ShardFields):
    """Layers [start_layer, end_layer) of the model; hidden states flow rank to rank."""


class TensorShardMetadata(_ShardFields):
    """All layers, 1/world_size of every attention head group and MLP column; ranks all-reduce."""


ShardMetadata = Annotated[
    Annotated[PipelineShardMetadata, Tag("PipelineShardMetadata")]
    | Annotated[TensorShardMetadata, Tag("TensorShardMetadata")],
    Discriminator(tag_of),
]

"""weight_arena: a layer's weights moved into one huge-page buffer keep their values, shapes and views of one
another, a storage shared outside the layer stays put, and a loaded model's layers are packed so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from skulk.engines.torch import weight_arena

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not weight_arena.huge_pages_available(), reason="needs Linux transparent huge pages")]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(256, 3000)
        stacked = torch.randn(3000 + 500, 256)
        self.stacked: torch.Tensor
        self.part: torch.Tensor
        self.register_buffer("stacked", stacked)
        self.register_buffer("part", stacked[3000:])  # a view, as fuse_projections' parts are
        self.register_buffer("params", torch.randn(2, 64, 8).half())


class Model(nn.Module):
    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.tied = nn.Parameter(layers[1].proj.bias.detach())  # shared outside the layers: stays where it is


def _smaps_huge_kb(address: int) -> int:
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        lines = smaps.read().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" in span and ":" not in span:
            low, high = (int(part, 16) for part in span.split("-"))
            if low <= address < high:
                return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("AnonHugePages:"))
    return 0


def test_a_layer_moves_into_one_buffer_with_its_values_and_views() -> None:
    layers = [Layer(), Layer()]
    model = Model(layers)
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    tied_at = layers[1].proj.bias.data_ptr()
    moved = weight_arena.pack_layers(layers, model)
    assert moved > 3000 * 256 * 4 * 2
    for layer, values in zip(layers, before, strict=True):
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, values[name]), name
        assert layer.part.data_ptr() == layer.stacked.data_ptr() + 3000 * 256 * 4  # still a view of it
        storages = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
        assert len(storages) == (1 if layer is layers[0] else 2)
    assert layers[1].proj.bias.data_ptr() == tied_at
    x = torch.randn(4, 256)
    assert torch.allclose(layers[0].proj(x), x @ before[0]["proj.weight"].T + before[0]["proj.bias"], atol=1e-5)
    assert _smaps_huge_kb(layers[0].stacked.data_ptr()) >= 2048  # backed by 2 MiB pages


def test_without_huge_pages_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Layer()
    monkeypatch.setattr(weight_arena, "huge_pages_available", lambda: False)
    at = layer.stacked.data_ptr()
    assert weight_arena.pack_layers([layer], layer) == 0 and layer.stacked.data_ptr() == at

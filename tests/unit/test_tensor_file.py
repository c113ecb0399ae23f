"""The loader's safetensors reader (engines/torch/tensor_file.py) gives what safetensors' own does, for every
block the loader asks for, and a stacked projection is kept in the buffer it was read into (issue 41)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from skulk.engines.torch.matmul import stacked
from skulk.engines.torch.tensor_file import TensorFile

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "a": torch.randn(12, 8, generator=gen).to(torch.bfloat16),
        "experts": torch.randn(3, 6, 8, generator=gen),
        "bias": torch.randn(12, generator=gen).to(torch.float16),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("name,index", [
    ("a", (slice(None), slice(None))), ("a", (slice(4, 8), slice(None))), ("a", (slice(None), slice(2, 6))),
    ("experts", (1, slice(None), slice(None))), ("experts", (2, slice(3, 6), slice(None))),
    ("experts", (0, slice(None), slice(4, 8))), ("bias", (slice(6, 12),)),
])
def test_blocks_read_as_indexed(weights: tuple[Path, dict[str, torch.Tensor]], name: str,
                                index: tuple[int | slice, ...]) -> None:
    path, tensors = weights
    want = tensors[name][index]
    with TensorFile(path) as file:
        got = file.get_slice(name)[index]
        assert got.dtype == want.dtype and torch.equal(got, want)
        into = torch.empty(want.shape, dtype=torch.float32)
        assert file.get_slice(name).read(index, into) is into
        assert torch.equal(into, want.float())


def test_a_wrong_destination_is_refused(weights: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = weights
    with TensorFile(path) as file, pytest.raises(ValueError, match="shape"):
        file.get_slice("a").read((slice(None), slice(None)), torch.empty(12, 9, dtype=torch.bfloat16))


def test_parts_read_into_one_buffer_stack_without_a_copy() -> None:
    buffer = torch.randn(10, 4)
    parts = list(buffer.split([6, 2, 2]))
    fused = stacked(parts)
    assert fused.data_ptr() == buffer.data_ptr() and torch.equal(fused, buffer)
    apart = [torch.randn(6, 4), torch.randn(2, 4)]
    assert torch.equal(stacked(apart), torch.cat(apart))
    assert stacked(apart).data_ptr() not in {t.data_ptr() for t in apart}

"""A rank whose peer died logs one line, not a stack trace; any other crash keeps its traceback."""

from __future__ import annotations

from skulk.runner.main import first_line, peer_gone


def test_peer_gone_errors_are_recognised() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:41234")
    assert peer_gone(gloo) and peer_gone(ConnectionResetError(104, "Connection reset by peer"))
    assert peer_gone(EOFError()) and peer_gone(BrokenPipeError())
    from torch.distributed import DistNetworkError

    store = DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server "
                             "shutdown or crash?\nException raised from recvBytes at ...\nframe #0: c10::Error")
    assert peer_gone(store) and first_line(store).startswith("DistNetworkError: Failed to recv, got 0 bytes.")
    assert "frame #0" not in first_line(store), "one line, not torch's C++ backtrace"
    assert first_line(gloo).startswith("RuntimeError: [../third_party/gloo")


def test_other_crashes_are_not_mistaken_for_a_dead_peer() -> None:
    assert not peer_gone(FileNotFoundError("config.json"))
    assert not peer_gone(RuntimeError("CUDA out of memory"))
    assert not peer_gone(ValueError("connection reset"))

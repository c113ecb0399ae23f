"""Gloo binds to the interface that routes to the rendezvous host, not to whatever the hostname resolves to."""

from __future__ import annotations

import sys

import psutil
import pytest

from skulk.runner.group import interface_towards


@pytest.mark.skipif(sys.platform != "linux", reason="interface names are Linux's")
def test_loopback_rendezvous_uses_the_loopback_interface() -> None:
    assert interface_towards("127.0.0.1") == "lo"


def test_the_chosen_interface_exists_or_nothing_is_chosen() -> None:
    for host in ("127.0.0.1", "192.0.2.1"):  # 192.0.2.0/24 is TEST-NET-1: routed by default, never reached
        name = interface_towards(host)
        assert name is None or name in psutil.net_if_addrs()


def test_an_unresolvable_host_chooses_nothing() -> None:
    assert interface_towards("no-such-host.invalid") is None

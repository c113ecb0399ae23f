"""The data ports (issue 44): the range the master draws a multi-rank rendezvous port from, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from skulk.cli import main
from skulk.config import ConfigError, parse_port_range, resolve
from skulk.master.placement import RENDEZVOUS_PORTS, new_rendezvous_port

pytestmark = pytest.mark.timeout(30)


def test_a_range_parses_inclusive() -> None:
    assert parse_port_range("29500-29999") == RENDEZVOUS_PORTS == range(29500, 30000)
    assert parse_port_range(" 31000-31000 ") == range(31000, 31001)
    assert parse_port_range("31000") == range(31000, 31001)


@pytest.mark.parametrize("text", ["", "abc", "31000-", "31010-31000", "80-90", "60000-70000", "1-2-3"])
def test_a_bad_range_says_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="expected FIRST-LAST"):
        parse_port_range(text)


def test_the_port_is_drawn_from_the_range_and_avoids_held_ones() -> None:
    ports = range(31000, 31003)
    drawn = {new_rendezvous_port(ports, used={31000, 31002}) for _ in range(50)}
    assert drawn == {31001}
    assert {new_rendezvous_port(ports) for _ in range(200)} == set(ports)
    assert new_rendezvous_port(ports, used=set(ports)) in ports  # all held: any (another host may hold them)


def test_an_mlx_ring_has_room_for_port_plus_rank() -> None:
    """Rank r of an MLX ring listens on port + r: a 3-node cluster's port leaves two more inside the range."""
    ports = range(31000, 31010)
    assert {new_rendezvous_port(ports, span=3) for _ in range(300)} == set(range(31000, 31008))
    held = set(range(31000, 31005))  # an instance's ring
    assert {new_rendezvous_port(ports, used=held, span=3) for _ in range(300)} == {31005, 31006, 31007}
    assert new_rendezvous_port(range(31000, 31002), span=5) == 31000  # narrower than the ring: its start


def test_flag_environment_and_file_set_it(tmp_path: Path) -> None:
    config = tmp_path / "skulk.yaml"
    config.write_text("data_ports: 31000-31099\n")
    base = {"config": str(config), "home": str(tmp_path)}
    assert resolve(base, {}).data_port_range == range(31000, 31100)
    assert resolve(base, {"SKULK_DATA_PORTS": "31100-31199"}).data_port_range == range(31100, 31200)
    flagged = resolve({**base, "data_ports": "31200-31201"}, {"SKULK_DATA_PORTS": "31100-31199"})
    assert flagged.data_ports == "31200-31201"
    assert resolve({"config": str(tmp_path / "none.yaml"), "home": str(tmp_path)}, {}).data_ports == "29500-29999"


def test_a_bad_range_stops_the_node_before_it_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="data ports '90-80'"):
        resolve({"home": str(tmp_path), "config": str(tmp_path / "none.yaml"), "data_ports": "90-80"}, {})
    with pytest.raises(SystemExit) as stopped:
        main(["--home", str(tmp_path), "--config", str(tmp_path / "none.yaml"), "--data-ports", "29999-29500"])
    assert stopped.value.code == 2
    assert "data ports '29999-29500'" in capsys.readouterr().err

"""`skulk service`: the systemd unit and launchd plist it renders, the files it writes, and what it asks the
service manager to do. systemd-analyze verifies the unit where it is installed (it checks ExecStart's binary,
the directives and the sections)."""

from __future__ import annotations

import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from skulk import service
from skulk.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)


def test_a_user_unit_restarts_on_failure_reads_its_env_file_and_logs_to_the_journal(tmp_path: Path) -> None:
    plan = service.layout(False, ["--api-port", "52415"], platform="linux", home=tmp_path, user="ada")
    assert plan.unit == tmp_path / ".config/systemd/user/skulk.service"
    unit = service.render_systemd(plan)
    assert f"ExecStart={sys.executable} -m skulk --api-port 52415" in unit
    assert f"EnvironmentFile=-{tmp_path}/.config/skulk/skulk.env" in unit
    for line in ("Restart=on-failure", "StartLimitBurst=5", "StandardOutput=journal", "KillMode=mixed",
                 "WantedBy=default.target"):
        assert line in unit.splitlines(), line
    assert "User=" not in unit, "a user unit runs as its user"
    system = service.render_systemd(service.layout(True, [], platform="linux", home=tmp_path, user="ada"))
    assert "User=ada" in system.splitlines() and "WantedBy=multi-user.target" in system


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    plan = service.layout(False, [], platform="linux", home=tmp_path, unit_dir=tmp_path / "units")
    service.write_files(plan, "linux")
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(plan.unit)], capture_output=True,
                          text=True, timeout=30, check=False)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "skulk.service" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr  # a bad directive is only printed
    plan.unit.write_text(plan.unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    bad = subprocess.run(["systemd-analyze", "verify", "--man=no", str(plan.unit)], capture_output=True, text=True,
                         timeout=30, check=False)
    assert "skulk.service" in bad.stdout + bad.stderr, "the check can fail"


def test_a_launchd_agent_keeps_the_node_alive_after_a_failure_only(tmp_path: Path) -> None:
    plan = service.layout(False, ["--node-name", "mac mini"], platform="darwin", home=tmp_path, user="ada")
    assert plan.unit == tmp_path / "Library/LaunchAgents/ai.skulk.node.plist"
    body = plistlib.loads(service.render_launchd(plan))
    assert body["Label"] == "ai.skulk.node" and body["KeepAlive"] == {"SuccessfulExit": False}
    script = body["ProgramArguments"][2]
    assert body["ProgramArguments"][:2] == ["/bin/sh", "-c"] and "set -a;" in script
    assert f"exec {sys.executable} -m skulk --node-name 'mac mini'" in script  # quoted for the shell
    assert body["StandardOutPath"].startswith(str(tmp_path / "Library/Logs/skulk")) and "UserName" not in body
    daemon = plistlib.loads(service.render_launchd(service.layout(True, [], platform="darwin", user="ada")))
    assert daemon["UserName"] == "ada"


def test_install_keeps_an_edited_env_file_private_and_uninstall_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SystemExit) as done:
        cli_main(["service", "install", "--no-start", "--", "--api-port", "52999"])
    assert done.value.code == 0
    unit = tmp_path / ".config/systemd/user/skulk.service"
    env = tmp_path / ".config/skulk/skulk.env"
    assert "--api-port 52999" in unit.read_text() and "SKULK_API_PORT" in env.read_text()
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    env.write_text("SKULK_CLUSTER_KEY_FILE=/secret\n")
    env.chmod(0o644)
    with pytest.raises(SystemExit):
        cli_main(["service", "install", "--no-start"])
    assert env.read_text() == "SKULK_CLUSTER_KEY_FILE=/secret\n" and stat.S_IMODE(env.stat().st_mode) == 0o600
    assert "--api-port" not in unit.read_text(), "a reinstall renders the unit afresh"
    with pytest.raises(SystemExit) as done:
        cli_main(["service", "uninstall", "--no-start"])
    assert done.value.code == 0 and not unit.exists() and env.exists()
    assert f"removed {unit}" in capsys.readouterr().out


def test_the_manager_is_asked_to_enable_start_and_stop_it(tmp_path: Path) -> None:
    user = service.layout(False, [], platform="linux", home=tmp_path)
    assert service.manager_commands(user, "install", "linux") == [
        ["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", "skulk.service"]]
    assert service.manager_commands(service.layout(True, [], platform="linux"), "uninstall", "linux") == [
        ["systemctl", "disable", "--now", "skulk.service"]]
    mac = service.layout(False, [], platform="darwin", home=tmp_path)
    assert service.manager_commands(mac, "install", "darwin")[0][:2] == ["launchctl", "bootstrap"]


def test_a_missing_service_manager_is_named_with_the_command_to_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert service._run([["no-such-manager-ctl", "enable", "skulk.service"]]) is False
    said = capsys.readouterr().err
    assert "no-such-manager-ctl is not on this machine" in said and "no-such-manager-ctl enable skulk.service" in said

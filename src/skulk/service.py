"""`skulk service install|status|uninstall`: run a node as a service of the machine, for months.

Linux: a systemd unit, a user unit by default (`~/.config/systemd/user/skulk.service`, started with the user's
session; `loginctl enable-linger` keeps it up without one) or, with --system, a system unit run as a named user.
macOS: a launchd agent (`~/Library/LaunchAgents/`) or, with --system, a daemon (`/Library/LaunchDaemons/`).
Either way:
- settings live in an env file beside it (SKULK_* lines: every flag has one; keys too, which is why the file is
  written 0600 and the unit names it instead of holding them), kept across reinstalls and uninstalls;
- the node restarts on failure, with a start limit, so a node that cannot start stops retrying;
- stop is SIGTERM to the node, which stops its runners; what is left after 30 s is killed;
- logs go to the journal (`journalctl --user -u skulk`) or, on macOS, to a file under ~/Library/Logs/skulk.

Rendering is pure (render_systemd, render_launchd); installing writes the files and asks systemctl/launchctl
to enable and start it. Where the service manager cannot be reached (a container without systemd), the files are
still written and the command to run is printed.
"""

from __future__ import annotations

import argparse
import getpass
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

NAME = "skulk"
LABEL = "ai.skulk.node"
"""The launchd label (reverse-DNS, as launchd wants)."""
ENV_TEMPLATE = """\
# Settings of the Skulk node run by the {manager} service: one SKULK_<SETTING>=value a line (see `skulk --help`).
# This file may hold keys: keep it 0600. Restart the service after editing it.
# SKULK_API_PORT=52415
# SKULK_API_HOST=0.0.0.0
# SKULK_NODE_NAME=my-node
# SKULK_CLUSTER_KEY_FILE=/path/to/cluster.key
# SKULK_MEMORY_LIMIT=80%
"""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a service's files go and what it runs."""

    system: bool
    unit: Path
    env_file: Path
    command: tuple[str, ...]
    user: str
    log_dir: Path | None = None
    """macOS only: where launchd writes the node's output."""


def layout(system: bool, node_args: list[str], *, platform: str = sys.platform, home: Path | None = None,
           user: str | None = None, unit_dir: Path | None = None) -> Layout:
    """The files and command for this machine. unit_dir overrides where the unit goes (tests, packagers)."""
    home = home or Path.home()
    user = user or os.environ.get("SUDO_USER") or getpass.getuser()
    command = (sys.executable, "-m", "skulk", *node_args)
    if platform == "darwin":
        unit = (Path("/Library/LaunchDaemons") if system else home / "Library" / "LaunchAgents") / f"{LABEL}.plist"
        env = Path("/etc/skulk/skulk.env") if system else home / ".config" / "skulk" / "skulk.env"
        logs = Path("/Library/Logs/skulk") if system else home / "Library" / "Logs" / "skulk"
        return Layout(system, (unit_dir / unit.name) if unit_dir else unit, env, command, user, logs)
    unit = (Path("/etc/systemd/system") if system else home / ".config" / "systemd" / "user") / f"{NAME}.service"
    env = Path("/etc/skulk/skulk.env") if system else home / ".config" / "skulk" / "skulk.env"
    return Layout(system, (unit_dir / unit.name) if unit_dir else unit, env, command, user)


def render_systemd(plan: Layout) -> str:
    """A systemd unit: restart on failure with a start limit, the env file, SIGTERM then SIGKILL after 30 s,
    the journal for logs."""
    lines = [
        "[Unit]",
        "Description=Skulk node: distributed LLM inference over this machine's memory",
        "Documentation=https://github.com/Foxlight-Foundation/Skulk",
        "After=network-online.target",
        "Wants=network-online.target",
        "StartLimitIntervalSec=300",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=simple",
        f"EnvironmentFile=-{plan.env_file}",
        f"ExecStart={shlex.join(plan.command)}",
        "Restart=on-failure",
        "RestartSec=5",
        "KillMode=mixed",
        "TimeoutStopSec=30",
        "StandardOutput=journal",
        "StandardError=journal",
        f"SyslogIdentifier={NAME}",
    ]
    if plan.system:
        lines.append(f"User={plan.user}")
    lines += ["", "[Install]", f"WantedBy={'multi-user.target' if plan.system else 'default.target'}", ""]
    return "\n".join(lines)


def render_launchd(plan: Layout) -> bytes:
    """A launchd plist: the env file read by a shell at each start (so an edit takes effect on restart), kept
    alive after a failing exit only, throttled, its output in a log file."""
    assert plan.log_dir is not None
    script = f"set -a; [ -f {shlex.quote(str(plan.env_file))} ] && . {shlex.quote(str(plan.env_file))}; " \
             f"exec {shlex.join(plan.command)}"
    body: dict[str, object] = {
        "Label": LABEL,
        "ProgramArguments": ["/bin/sh", "-c", script],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,
        "ExitTimeOut": 30,
        "ProcessType": "Interactive",
        "StandardOutPath": str(plan.log_dir / "node.log"),
        "StandardErrorPath": str(plan.log_dir / "node.log"),
    }
    if plan.system:
        body["UserName"] = plan.user
    return plistlib.dumps(body)


def write_files(plan: Layout, platform: str = sys.platform) -> list[Path]:
    """The unit (replaced) and the env file (kept if there, else a commented template, 0600); what was written."""
    written: list[Path] = []
    plan.unit.parent.mkdir(parents=True, exist_ok=True)
    if platform == "darwin":
        plan.unit.write_bytes(render_launchd(plan))
        if plan.log_dir is not None:
            plan.log_dir.mkdir(parents=True, exist_ok=True)
    else:
        plan.unit.write_text(render_systemd(plan))
    written.append(plan.unit)
    if not plan.env_file.exists():
        plan.env_file.parent.mkdir(parents=True, exist_ok=True)
        plan.env_file.write_text(ENV_TEMPLATE.format(manager="launchd" if platform == "darwin" else "systemd"))
        written.append(plan.env_file)
    plan.env_file.chmod(0o600)
    return written


def manager_commands(plan: Layout, action: str, platform: str = sys.platform) -> list[list[str]]:
    """What enables and starts (install), shows (status) or stops and disables (uninstall) the service."""
    if platform == "darwin":
        domain = "system" if plan.system else f"gui/{os.getuid()}"
        return {"install": [["launchctl", "bootstrap", domain, str(plan.unit)]],
                "status": [["launchctl", "print", f"{domain}/{LABEL}"]],
                "uninstall": [["launchctl", "bootout", f"{domain}/{LABEL}"]]}[action]
    ctl = ["systemctl"] if plan.system else ["systemctl", "--user"]
    return {"install": [[*ctl, "daemon-reload"], [*ctl, "enable", "--now", f"{NAME}.service"]],
            "status": [[*ctl, "status", "--no-pager", f"{NAME}.service"]],
            "uninstall": [[*ctl, "disable", "--now", f"{NAME}.service"]]}[action]


def _run(commands: list[list[str]]) -> bool:
    """Run each command in turn; False (having said why) at the first that cannot run or fails."""
    for command in commands:
        if shutil.which(command[0]) is None:
            print(f"skulk service: {command[0]} is not on this machine; run it where the service manager is: "
                  f"{shlex.join(command)}", file=sys.stderr)
            return False
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            print(f"skulk service: `{shlex.join(command)}` exited {done.returncode}", file=sys.stderr)
            return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skulk service", description="Run this node as a systemd or launchd service.")
    parser.add_argument("action", choices=["install", "status", "uninstall"])
    parser.add_argument("--system", action="store_true",
                        help="a system service (root): systemd system unit / launchd daemon, run as --user")
    parser.add_argument("--user", help="who a --system service runs as (default: the invoking user)")
    parser.add_argument("--unit-dir", type=Path, help="write the unit here instead of the manager's directory")
    parser.add_argument("--no-start", action="store_true", help="write the files only; enable nothing")
    parser.epilog = ("after --, the node's own flags: skulk service install -- --api-port 52415 (settings are "
                     "better kept in the env file)")
    return parser


def main(argv: list[str]) -> int:
    ours, node_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    plan = layout(args.system, node_args, user=args.user, unit_dir=args.unit_dir)
    if args.action == "install":
        for path in write_files(plan):
            print(f"wrote {path}")
        if args.no_start:
            return 0
        started = _run(manager_commands(plan, "install"))
        print(f"settings: {plan.env_file} (restart the service after editing it)")
        return 0 if started else 1
    if args.action == "status":
        print(f"unit: {plan.unit} ({'installed' if plan.unit.exists() else 'not installed'})")
        print(f"settings: {plan.env_file}")
        return 0 if _run(manager_commands(plan, "status")) else 1
    stopped = _run(manager_commands(plan, "uninstall")) if plan.unit.exists() and not args.no_start else True
    if plan.unit.exists():
        plan.unit.unlink()
        print(f"removed {plan.unit}; kept {plan.env_file}")
    return 0 if stopped else 1

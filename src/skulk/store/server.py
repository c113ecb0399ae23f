"""The store host's file server: the authoritative copies under store_path, over HTTP on the LAN.

Only complete models are listed or served; Range requests let a stager resume. Nothing outside store_path is
reachable: a model id must be `org/name` without dot segments, a file name a plain name of the model's
directory; anything else is 400, a missing model or file 404.

It is the standard library's threaded HTTP server, not the node's FastAPI app, because staging is a bulk copy:
each request gets its own thread and the file goes out with `sendfile` (kernel to socket, no Python copies),
so a transfer neither waits on the node's event loop nor slows it down. On loopback this stages at about the
speed of a local file copy, where streaming the file through the event loop reached less than half of it.

With a cluster key (or admin keys) every request must carry the cluster's internal token (internal_auth, the
header peers' API calls carry): anyone who could reach the port read the registry and every weight file before
(issue 27). Without either there is no secret to prove, as for the API. It binds the address peers are told
to dial (store_address) when that is one of this host's own, else the API's host (bind_address).

When the node serves its API over TLS (--tls-cert) the store does too, with the same pair: the weights and the
signed headers are not read off the wire, and a stager verifies the store as it verifies any peer (peer_tls).
`sendfile` then goes through Python's TLS layer, a copy per byte.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from skulk import internal_auth
from skulk.store.files import (
    MODEL_ID,
    NEEDED_NESTED,
    file_hashes,
    is_complete,
    local_files,
    model_dir_name,
    read_marker,
)
from skulk.types import versions
from skulk.types.errors import ApiError, ErrorCode, error_body

log = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 60.0
"""A connection that sends nothing for this long is closed, so idle or stalled clients cannot pile up."""

_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def safe_part(part: str, what: str) -> str:
    """One path component that cannot climb out of its directory."""
    if not _PART.fullmatch(part) or ".." in part:
        raise ApiError(ErrorCode.invalid_path,
                       f"invalid {what} {part!r}")
    return part


def model_path(store_path: Path, model_id: str) -> Path:
    """The store's folder of a model id (org/name, or an Ollama import's [namespace/]name:tag)."""
    if not MODEL_ID.fullmatch(model_id) or ".." in model_id:
        raise ApiError(ErrorCode.invalid_path,
                       f"invalid model id {model_id!r}; expected org/name")
    path = store_path / model_dir_name(model_id)
    if store_path.resolve() not in path.resolve().parents:
        raise ApiError(ErrorCode.invalid_path,
                       f"invalid model id {model_id!r}")
    return path


def _split_files_route(parts: list[str]) -> tuple[str, list[str]] | None:
    """`models/<id>/files[/<file>]` → (the id, what follows `files`): an id is org/name, or an Ollama name with a
    tag (`smollm2:135m`, one part: no Hugging Face org or name has a colon)."""
    if len(parts) < 3 or parts[0] != "models":
        return None
    width = 1 if ":" in parts[1] else 2
    if len(parts) < 2 + width or parts[1 + width] != "files":
        return None
    return "/".join(parts[1 : 1 + width]), parts[2 + width :]


def registry(store_path: Path) -> list[dict[str, Any]]:
    """The complete models of the store, as /store/registry lists them."""
    entries = []
    if store_path.is_dir():
        for path in sorted(p for p in store_path.iterdir() if p.is_dir() and is_complete(p)):
            marker = read_marker(path)
            files = local_files(path)
            entries.append(
                {
                    "model_id": marker.model_id if marker else path.name.replace("--", "/", 1),
                    "total_bytes": sum(files.values()),
                    "downloaded_at": marker.downloaded_at.isoformat() if marker else None,
                }
            )
    return entries


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a `Range: bytes=a-[b]` header; None = the whole file. ApiError 416 when it lies
    past the end. Suffix and multi-part ranges are not asked for by stagers and get the whole file."""
    match = _RANGE.fullmatch(header.strip()) if header else None
    if match is None:
        return None
    first = int(match.group(1))
    last = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
    if first >= size or last < first:
        raise ApiError(ErrorCode.range_not_satisfiable,
                       f"range {header} lies outside the file's {size} bytes")
    return first, last


def route(store_path: Path, raw_path: str) -> dict[str, Any] | Path:
    """What a GET of raw_path answers: a JSON body or a file to send. Pure apart from reading store_path."""
    parts = [unquote(p) for p in urlsplit(raw_path).path.split("/")[1:]]
    if parts == ["registry"]:
        return {"entries": registry(store_path)}
    split = _split_files_route(parts)
    if split is not None and len(split[1]) == 2 and "/".join(split[1]) in NEEDED_NESTED:  # 1_Pooling/config.json
        split = (split[0], ["/".join(split[1])])
    if split is not None and len(split[1]) <= 1:
        model_id, rest = split
        folder = model_path(store_path, model_id)
        if not rest:
            if not folder.is_dir() or not is_complete(folder):
                raise ApiError(ErrorCode.model_not_in_store,
                               f"the store has no complete copy of {model_id}")
            files = local_files(folder)
            return {"model_id": model_id, "files": files, "sha256": file_hashes(folder, files)}
        path = folder / (rest[0] if rest[0] in NEEDED_NESTED else safe_part(rest[0], "file name"))
        if not path.is_file() or not is_complete(folder):
            raise ApiError(ErrorCode.file_not_in_store,
                           f"the store has no file {rest[0]} of {model_id}")
        return path
    raise ApiError(ErrorCode.not_found,
                   f"no such store route {raw_path!r}")


def bind_address(api_host: str, dialed: str | None, own: set[str]) -> str:
    """Where the store listens (pure): the address peers dial when it is this host's (one interface, not all of
    them), else the API's host."""
    return dialed if dialed is not None and dialed in own else api_host


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S

    def do_GET(self) -> None:
        try:
            self._authenticate()
            answer = route(cast(StoreServer, self.server).store_path, self.path)
            if isinstance(answer, Path):
                self._send_file(answer)
            else:
                self._send_json(200, answer)
        except ApiError as exc:
            self._send_json(exc.status, error_body(exc.message, kind=exc.kind, code=exc.code))

    def _authenticate(self) -> None:
        """Every call signed for the store by a node of the cluster, once (internal_auth: a captured read
        replayed, or its path altered, is refused), of a format version this node works with."""
        refused = internal_auth.version_refusal(self.headers.get(versions.HEADER), "a peer's store call")
        if refused is not None:
            raise ApiError(ErrorCode.format_version_refused, refused)
        auth = internal_auth.current()
        if auth is None:
            return
        value = self.headers.get(internal_auth.HEADER)
        if value is None:
            raise ApiError(ErrorCode.missing_internal_token, "the model store serves only nodes of its cluster (the "
                           "internal signature is missing: start this node with the cluster's --cluster-key)")
        found = auth.verify(self.command, self.path, value, frozenset({internal_auth.STORE_TARGET}))
        if isinstance(found, internal_auth.Refusal):
            raise ApiError(ErrorCode.invalid_internal_token, f"the model store serves only nodes of its cluster: "
                           f"{found.value}")

    def _not_allowed(self) -> None:
        try:
            self._authenticate()
        except ApiError as exc:
            self._send_json(exc.status, error_body(exc.message, kind=exc.kind, code=exc.code))
            return
        body = error_body(f"{self.command} is not allowed; the store is read-only", kind="invalid_request_error",
                          code=ErrorCode.method_not_allowed.value)
        self._send_json(405, body, allow="GET")

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed

    def _send_json(self, status: int, body: dict[str, Any], allow: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        self.wfile.write(data)

    def _send_file(self, path: Path) -> None:
        with path.open("rb") as file:
            size = path.stat().st_size
            span = byte_range(self.headers.get("Range"), size)
            first, last = span or (0, size - 1)
            self.send_response(HTTPStatus.PARTIAL_CONTENT if span else HTTPStatus.OK)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(last - first + 1))
            if span:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.end_headers()
            self.wfile.flush()
            if size:
                sent = self.connection.sendfile(file, offset=first, count=last - first + 1)
                cast(StoreServer, self.server).on_sent(sent)

    def setup(self) -> None:
        """The TLS handshake here, on the connection's own thread under its timeout, not in the accept loop
        (where one silent client would hold every other)."""
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("store %s: " + format, self.address_string(), *args)


class StoreServer(ThreadingHTTPServer):
    """Serves store_path until close(); a thread per connection, daemon threads so a stalled client never
    holds the node open at exit."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, store_path: Path, host: str, port: int, on_sent: Callable[[int], None] = lambda _: None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.store_path = store_path
        self.on_sent = on_sent
        """Told the bytes of each file sent, on the sending thread (the node counts them for GET /metrics)."""
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        if tls is not None:  # https, as the API: a cluster serves TLS everywhere or nowhere (peer_tls.py)
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self.serve_forever, name="store-server", daemon=True)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that fails the handshake (plain http, an untrusted certificate) or drops is a debug line, not
        a traceback on stderr."""
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError, TimeoutError)):
            log.debug("store client %s: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)

    def start(self) -> StoreServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()

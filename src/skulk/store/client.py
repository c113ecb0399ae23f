"""Staging from the LAN store host: list a model's files there, fetch the ones a shard needs."""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from skulk import internal_auth, peer_tls
from skulk.store.fetch import Progress, Pump, chunks_pump, fetch_all, fetch_file
from skulk.store.files import INDEX_FILE, sha256_of

TIMEOUT_S = 30.0
HASH_TIMEOUT_S = 600.0
READ_BYTES = 4 * 1024 * 1024
PIPE_BYTES = 1024 * 1024


class NotInStore(LookupError):
    pass


class StoreUnreachable(ConnectionError):
    pass


def store_url(host: str, port: int) -> str:
    return peer_tls.base_url(host, port)


class CorruptCopy(OSError):
    """A staged file's SHA-256 differs from the store's: it was removed, and staging fails (and is retried)."""


def store_listing(base: str, model_id: str) -> tuple[dict[str, int], dict[str, str]]:
    """The files of the store's complete copy of model_id and their SHA-256; NotInStore when it has none. The
    first listing of a model makes the store hash it (once), hence the long read timeout."""
    try:
        response = httpx.get(f"{base}/models/{model_id}/files", auth=internal_auth.signer(internal_auth.STORE_TARGET),
                             timeout=httpx.Timeout(10.0, read=HASH_TIMEOUT_S), verify=peer_tls.verify())
    except httpx.TransportError as exc:
        raise StoreUnreachable(f"the model store at {base} is unreachable: {exc}") from exc
    if response.status_code == 404:
        raise NotInStore(response.text)
    response.raise_for_status()
    body = response.json()
    hashes = body.get("sha256") or {}
    return {str(k): int(v) for k, v in body["files"].items()}, {str(k): str(v) for k, v in hashes.items()}


def store_files(base: str, model_id: str) -> dict[str, int]:
    """The files of the store's complete copy of model_id; NotInStore when it has none."""
    return store_listing(base, model_id)[0]


def verify(target: Path, names: Iterable[str], sha256: Mapping[str, str]) -> None:
    """Each staged file whose hash the store gave must match it; a file that does not is removed (a corrupt copy
    or a store that changed under us must not be loaded), and CorruptCopy raised."""
    for name in names:
        expected = sha256.get(name)
        if expected is None:
            continue
        path = target / name
        if sha256_of(path) != expected:
            path.unlink(missing_ok=True)
            raise CorruptCopy(f"staged {name} does not match the store's SHA-256; it was removed and is staged again")


def fetch_index(base: str, model_id: str, files: dict[str, int], target: Path) -> Path | None:
    """The safetensors index into target (it says which files hold which layers), when the model has one."""
    if INDEX_FILE not in files:
        return None
    target.mkdir(parents=True, exist_ok=True)
    url = file_url(base, model_id, INDEX_FILE)
    fetch_file(open_store_stream, url, target / INDEX_FILE, files[INDEX_FILE], on_bytes=lambda _n: None)
    return target / INDEX_FILE


def file_url(base: str, model_id: str, name: str) -> str:
    return f"{base}/models/{model_id}/files/{name}"


@contextmanager
def open_store_stream(url: str, start: int) -> Iterator[tuple[int, Pump]]:
    """One GET to the store's file server with the standard library's http.client: the store speaks plain
    HTTP/1.1 without redirects (over TLS when the cluster serves it), and owning the socket lets a plain-http
    body be spliced straight into the file."""
    parts = urlsplit(url)
    tls = peer_tls.context() if parts.scheme == "https" else None
    conn = (http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=TIMEOUT_S, context=tls)
            if tls is not None else http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=TIMEOUT_S))
    try:
        signed = internal_auth.signed_headers("GET", parts.path, internal_auth.STORE_TARGET)
        headers = {**signed, **({"Range": f"bytes={start}-"} if start else {})}
        conn.request("GET", parts.path, headers=headers)
        response = conn.getresponse()
        if response.status == 404:
            raise NotInStore(response.read().decode(errors="replace"))
        if response.status >= 400:
            raise OSError(f"the store answered HTTP {response.status} for {parts.path}")
        length = int(response.getheader("Content-Length") or 0)
        if hasattr(os, "splice") and conn.sock is not None and tls is None and length:  # TLS: bytes need decrypting
            yield response.status, _splice_pump(response, conn.sock, length)
        else:
            yield response.status, chunks_pump(iter(lambda: response.read1(READ_BYTES), b""))
    finally:
        conn.close()


def _splice_pump(response: http.client.HTTPResponse, sock: socket.socket, length: int) -> Pump:
    """Linux: the body moves socket → pipe → file inside the kernel (splice), so staging runs at about the
    speed of a local copy; through Python it costs two copies per byte and reaches about half of it. The
    bytes http.client already buffered with the headers are written first."""

    def pump(fd: int, on_bytes: Callable[[int], None]) -> None:
        head = response.fp.read(len(response.fp.peek()))  # type: ignore[union-attr]  # the buffered start
        os.write(fd, head)
        on_bytes(len(head))
        left = length - len(head)
        # Blocking splice with a kernel receive timeout: a timeout set in Python makes the socket non-blocking,
        # and polling before every splice costs a third of the throughput.
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(TIMEOUT_S), 0))
        pipe_out, pipe_in = os.pipe()
        try:
            with contextlib.suppress(OSError):  # a bigger pipe means fewer calls; the default 64 KiB works too
                fcntl.fcntl(pipe_in, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            while left > 0:
                try:
                    moved = os.splice(sock.fileno(), pipe_in, min(left, PIPE_BYTES))
                except BlockingIOError:
                    raise TimeoutError(f"the store sent nothing for {TIMEOUT_S:.0f} s") from None
                if moved == 0:
                    return  # the store closed early; the size check makes the caller retry from here
                pending = moved
                while pending:
                    pending -= os.splice(pipe_out, fd, pending)
                on_bytes(moved)
                left -= moved
        finally:
            os.close(pipe_out)
            os.close(pipe_in)

    return pump


def stage(
    base: str,
    model_id: str,
    files: dict[str, int],
    target: Path,
    on_progress: Progress | None,
    sha256: Mapping[str, str] | None = None,
) -> None:
    """The named files from the store into target, resumable, each checked against the store's SHA-256 (when
    given) before the completion marker is written."""
    urls = {name: file_url(base, model_id, name) for name in files}
    fetch_all(urls, files, target, model_id=model_id, on_progress=on_progress, opener=open_store_stream,
              check=lambda: verify(target, files, sha256 or {}))

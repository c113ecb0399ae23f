"""A passive listener on the loopback interface, as an attacker on the LAN would run one: it reads every TCP
segment sent to the given ports (an AF_PACKET socket, root only) and rebuilds the HTTP/1.1 requests in them, so
a test can replay exactly what crossed the wire. It holds no key and never talks to a node while listening."""

from __future__ import annotations

import os
import socket
import struct
import threading
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def can_capture() -> str | None:
    """None when this process may open a raw socket on lo, else why not (the test skips with it)."""
    if os.geteuid() != 0:
        return "capturing loopback traffic needs root (CAP_NET_RAW)"
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL)).close()
    except (OSError, AttributeError) as exc:
        return f"no AF_PACKET socket here: {exc}"
    return None


@dataclass(frozen=True)
class Captured:
    port: int
    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass
class LoopbackCapture:
    ports: frozenset[int]
    _segments: dict[tuple[int, int], dict[int, bytes]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> LoopbackCapture:
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sock.close()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                frame, address = self._sock.recvfrom(262144)
            except TimeoutError:
                continue
            except OSError:
                return
            if address[2] != PACKET_OUTGOING:  # lo shows each segment twice: keep the received copy
                self._take(frame)

    def _take(self, frame: bytes) -> None:
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4, TCP
            return
        ihl = (frame[14] & 0x0F) * 4
        tcp = 14 + ihl
        sport, dport, seq = struct.unpack("!HHI", frame[tcp:tcp + 8])
        total = struct.unpack("!H", frame[16:18])[0]
        payload = frame[tcp + (frame[tcp + 12] >> 4) * 4:14 + total]
        if dport in self.ports and payload:
            self._segments.setdefault((sport, dport), {})[seq] = payload

    def requests(self) -> list[Captured]:
        """Every complete request seen so far, per connection in order."""
        found: list[Captured] = []
        for (_sport, dport), segments in list(self._segments.items()):
            stream = b"".join(segments[s] for s in sorted(segments))
            found.extend(_parse(dport, stream))
        return found


def _parse(port: int, stream: bytes) -> list[Captured]:
    requests = []
    while b"\r\n\r\n" in stream:
        head, stream = stream.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            break
        headers = tuple((k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line))
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        if len(stream) < length:
            break
        body, stream = stream[:length], stream[length:]
        requests.append(Captured(port, parts[0], parts[1], headers, body))
    return requests

"""A real TCP proxy between an S3 client and the test's S3 server, delivering the faults a network and a store
deliver: a response lost after the server acted on the request (a reset connection, a load balancer's timeout),
``500 InternalError`` and ``503 SlowDown``.

Every request is read whole (head and body; ``Expect: 100-continue`` answered here), classified
(:attr:`Request.kind`), recorded, and then either answered here with an error status, or forwarded
to the server on a fresh connection whose response is read to its end -- and then relayed, or, for
a lost response, dropped by closing the client's connection without a byte. The client sees what it
would see in production: a connection closed before any response, after the store did the work.
Threads, one per client connection; :meth:`FaultProxy.close` stops accepting.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

FaultKind = Literal["lose", "500", "503"]
FAULTS: tuple[FaultKind, ...] = ("lose", "500", "503")

_ERRORS = {
    "500": (b"500 Internal Server Error", b"InternalError", b"We encountered an internal error. Please try again."),
    "503": (b"503 Slow Down", b"SlowDown", b"Please reduce your request rate."),
}


@dataclass(frozen=True)
class Request:
    """One request as the proxy read it (header names lower-case)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]

    @property
    def key(self) -> str:
        """The object key (path-style addressing: ``/bucket/key``); empty for a request on the bucket."""
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) > 1 else ""

    @property
    def kind(self) -> str:
        """What the request does: ``list``, ``get``, ``head``, ``put``, ``put-if-none-match``, ``copy``,
        ``delete``, ``delete-batch``, ``multipart`` or ``other``."""
        params = urllib.parse.parse_qs(self.query, keep_blank_values=True)
        if self.method == "GET":
            return "list" if not self.key or "list-type" in params or "prefix" in params else "get"
        if self.method == "HEAD":
            return "head"
        if self.method == "PUT":
            if "x-amz-copy-source" in self.headers:
                return "copy"
            if "uploadId" in params:
                return "multipart"
            return "put-if-none-match" if "if-none-match" in self.headers else "put"
        if self.method == "DELETE":
            return "multipart" if "uploadId" in params else "delete"
        if self.method == "POST":
            return "delete-batch" if "delete" in params else "multipart"
        return "other"


@dataclass
class Fault:
    """``what`` happens to the next ``times`` requests ``match`` accepts."""

    what: FaultKind
    match: Callable[[Request], bool]
    times: int = 1
    hits: int = 0


@dataclass
class FaultProxy:
    """Listens on a free loopback port (:attr:`endpoint`) and forwards to ``upstream`` (``http://host:port``)."""

    upstream: str
    seen: list[tuple[Request, str]] = field(default_factory=list)
    """Every request, with what it got: the status relayed, ``"lost"``, or the injected status."""

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.upstream)
        self._target = (parsed.hostname or "127.0.0.1", int(parsed.port or 80))
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._open = True
        self._thread = threading.Thread(target=self._accept, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def inject(self, what: FaultKind, match: Callable[[Request], bool], *, times: int = 1) -> Fault:
        """From now on, the next ``times`` requests ``match`` accepts get ``what``."""
        if what not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {what!r}")
        fault = Fault(what, match, times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def reset(self) -> None:
        """Forget every fault and every request seen."""
        with self._lock:
            self._faults.clear()
            self.seen.clear()

    def counts(self) -> Counter[str]:
        """Requests seen, by :attr:`Request.kind`."""
        with self._lock:
            return Counter(r.kind for r, _ in self.seen)

    def close(self) -> None:
        self._open = False
        self._thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _accept(self) -> None:
        while self._open:
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._serve, args=(conn,), name="s3-fault-proxy-conn", daemon=True).start()

    def _fault_for(self, request: Request) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.hits < fault.times and fault.match(request):
                    fault.hits += 1
                    return fault
        return None

    def _record(self, request: Request, outcome: str) -> None:
        with self._lock:
            self.seen.append((request, outcome))

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(60)
            reader = conn.makefile("rb")
            while True:
                head = _read_head(reader)
                if head is None:
                    return
                line, headers = _parse_head(head)
                method, target, _version = line.split(" ", 2)
                names = {name.lower(): value for name, value in headers}
                if names.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(reader, names)
                path, _, query = target.partition("?")
                request = Request(method, urllib.parse.unquote(path), query, names)
                fault = self._fault_for(request)
                if fault is not None and fault.what in _ERRORS:
                    status, code, message = _ERRORS[fault.what]
                    payload = (
                        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>%s</Code><Message>%s</Message></Error>"
                    )
                    data = payload % (code, message)
                    conn.sendall(
                        b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n%s"
                        % (status, len(data), data)
                    )
                    self._record(request, fault.what)
                    continue
                forwarded = [(n, v) for n, v in headers if n.lower() not in ("connection", "expect")]
                response = self._forward(line, [*forwarded, ("Connection", "close")], body)
                if fault is not None:  # "lose": the server acted; the client hears nothing
                    self._record(request, "lost")
                    conn.shutdown(socket.SHUT_RDWR)
                    return
                status_line, response_headers = _parse_head(response[: response.index(b"\r\n\r\n") + 4])
                self._record(request, status_line.split(" ")[1])
                framed = {n.lower() for n, _ in response_headers} & {"content-length", "transfer-encoding"}
                keep = [(n, v) for n, v in response_headers if n.lower() != "connection"]
                relayed = _render(status_line, keep) + response[response.index(b"\r\n\r\n") + 4 :]
                conn.sendall(relayed)
                if not framed and method != "HEAD":
                    return  # delimited by the close

    def _forward(self, line: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
        with socket.create_connection(self._target, timeout=60) as upstream:
            upstream.sendall(_render(line, headers) + body)
            chunks = []
            while data := upstream.recv(1 << 16):
                chunks.append(data)
        return b"".join(chunks)


def _read_head(reader) -> bytes | None:
    lines = []
    while True:
        line = reader.readline(1 << 16)
        if not line:
            return None if not lines else b"".join(lines)
        if line in (b"\r\n", b"\n") and not lines:
            continue  # stray line between requests
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for text in lines[1:]:
        if text:
            name, _, value = text.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _render(line: str, headers: list[tuple[str, str]]) -> bytes:
    return (line + "\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers) + "\r\n").encode("latin-1")


def _read_body(reader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = []
        while True:
            size_line = reader.readline(1 << 16)
            out.append(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = reader.readline(1 << 16)
                    out.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(out)
            out.append(reader.read(size + 2))
    length = int(headers.get("content-length", "0") or 0)
    return reader.read(length) if length else b""

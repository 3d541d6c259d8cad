"""Headless Chromium for the report test, driven over the DevTools protocol (a few commands, one websocket).

:func:`open_pages` starts the browser (``--remote-debugging-port=0``: it picks a free port and
writes it to ``DevToolsActivePort`` in its profile), opens each page at a fixed window size,
collects what the console would show as an error (``console.error``, uncaught exceptions, the
browser's own error log: a resource that failed to load, a refused style), evaluates a script in
the rendered page, and takes a screenshot. The browser is stopped by its pid.

Note: aiohttp's websocket client is used because it is already installed (s3fs depends on it);
no browser-automation package is needed for these five commands.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


@dataclass
class Rendered:
    """One page as the browser rendered it."""

    url: str
    errors: list[str] = field(default_factory=list)
    """What the console shows as an error: console.error/assert, uncaught exceptions, the browser's error log."""
    value: Any = None
    """What the page script returned (JSON)."""
    png: bytes = b""


class _Session:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json()
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self.events.append(msg)

    async def until(self, method: str) -> None:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(await self.ws.receive_json())


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            out.append("exception: " + str(details.get("exception", {}).get("description", details.get("text"))))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            out.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}".strip())
    return out


async def _render(http: aiohttp.ClientSession, port: int, url: str, script: str, size: tuple[int, int]) -> Rendered:
    async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as response:
        target = await response.json()
    async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
        s = _Session(ws)
        for domain in ("Page", "Runtime", "Log"):
            await s.call(f"{domain}.enable")
        width, height = size
        await s.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
        )
        await s.call("Page.navigate", url=url)
        await s.until("Page.loadEventFired")
        value = await s.call("Runtime.evaluate", expression=script, returnByValue=True)
        shot = await s.call("Page.captureScreenshot", format="png")
        return Rendered(
            url=url, errors=_errors(s.events), value=value["result"].get("value"), png=base64.b64decode(shot["data"])
        )


def _port(profile: Path, proc: subprocess.Popen[bytes], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    active = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the browser exited with {proc.returncode} before it listened")
        if active.is_file() and active.read_text().strip():
            return int(active.read_text().split()[0])
        time.sleep(0.1)
    raise TimeoutError(f"the browser wrote no {active} within {timeout} s")


def open_pages(
    browser: str, urls: list[str], *, script: str, size: tuple[int, int] = (1000, 2400), timeout: float = 60
) -> list[Rendered]:
    """Render each of ``urls`` in one headless Chromium; ``script`` (a JS expression) is evaluated in each."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [browser, *FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port = _port(Path(profile), proc, timeout)

            async def run() -> list[Rendered]:
                async with aiohttp.ClientSession() as http:
                    return [await _render(http, port, url, script, size) for url in urls]

            return asyncio.run(asyncio.wait_for(run(), timeout))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

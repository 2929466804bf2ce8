"""Headless Chromium driven over the DevTools protocol (websocket JSON-RPC): enough to drive one page of the
service in the browser tests. Debian's chromium, started with --headless --no-sandbox --disable-gpu."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.app.live import DEADLINE_S

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


# ---------------------------------------------------------------------------------------------------
# A small DevTools-protocol client (websocket JSON-RPC), enough to drive one page.


class CDPError(RuntimeError):
    pass


class Page:
    """One Chromium page target, spoken to over its DevTools websocket."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self._ws = connect(ws_url, max_size=None, open_timeout=30)
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def close(self) -> None:
        self._ws.close()

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CDPError(f"{method}: no reply in {timeout} s")
            reply = json.loads(self._ws.recv(timeout=remaining))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            if "method" in reply:
                self.events.append(reply)

    def js(self, expression: str) -> Any:
        """Evaluate an expression in the page (promises awaited) and return its JSON value."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise CDPError(f"page exception in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = DEADLINE_S) -> Any:
        """Poll ``expression`` until it is truthy; fail the test with ``what`` and the page state if never."""
        deadline = time.monotonic() + timeout
        last_error = ""
        while True:
            try:
                value = self.js(expression)
            except CDPError as exc:  # e.g. the document is being replaced during a navigation
                value, last_error = None, str(exc)
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{what} did not happen within {timeout:.0f} s; last error: {last_error[:500]}; "
                    f"page state: {self.snapshot()}"
                )
            time.sleep(0.1)

    def snapshot(self) -> str:
        return str(self.js("document.querySelector('main') ? document.querySelector('main').innerText : ''"))[
            :2000
        ]

    def exceptions(self) -> list[str]:
        self.call("Runtime.evaluate", expression="0")  # flush pending events into self.events
        return [
            json.dumps(e["params"].get("exceptionDetails", {}))[:500]
            for e in self.events
            if e.get("method") == "Runtime.exceptionThrown"
        ]

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@dataclass
class Browser:
    proc: subprocess.Popen[bytes]
    profile: Path
    page: Page
    logs: list[str] = field(default_factory=list)

    def close(self) -> None:
        try:
            self.page.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            shutil.rmtree(self.profile, ignore_errors=True)


def launch_chromium() -> Browser:
    profile = Path(tempfile.mkdtemp(prefix="ragspec-chromium-"))
    args = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        "about:blank",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            shutil.rmtree(profile, ignore_errors=True)
            pytest.fail(f"chromium did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    port = int(port_file.read_text().splitlines()[0])
    ws_url = ""
    while not ws_url:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            targets = json.load(resp)
        ws_url = next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), "")
        if not ws_url:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("chromium has no page target")
            time.sleep(0.05)
    page = Page(ws_url)
    page.call("Page.enable")
    page.call("Runtime.enable")
    page.call("DOM.enable")
    return Browser(proc=proc, profile=profile, page=page)


@contextmanager
def open_browser() -> Iterator[Browser]:
    """A fresh headless Chromium with one page; fails the test when chromium is not installed."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed (apt-get install chromium); .ci/run installs it")
    b = launch_chromium()
    try:
        yield b
    finally:
        b.close()


def open_page(page: Page, url: str) -> None:
    """Navigate to the service's page at ``url`` and wait until it has loaded its data (documents, modes)."""
    page.call("Page.navigate", url=url)
    page.wait_for("document.documentElement.dataset.loaded === '1'", "the page loading its data")

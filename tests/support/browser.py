"""A real browser for tests: Debian's headless Chromium, driven over the DevTools protocol on loopback.

`Browser` starts one `chromium --headless` with a private profile and a DevTools port, and drives its one tab
through the protocol's WebSocket (aiohttp, already a dependency): navigate, evaluate JavaScript, type into a
field, press a key, click or hover an element with real mouse events, take a screenshot. scripts/setup.sh
installs the package (`apt-get install chromium`); `find_chromium()` is None where it is missing.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium tab. Use as a context manager; every call blocks until the browser answered."""

    def __init__(self, binary: str, width: int = 1280, height: int = 900):
        self.binary, self.width, self.height = binary, width, height
        self.profile = Path(tempfile.mkdtemp(prefix="polar-chromium-"))
        self.loop = asyncio.new_event_loop()
        self.ids = itertools.count(1)
        self.process: subprocess.Popen[bytes] | None = None
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    # -- life
    def __enter__(self) -> Browser:
        self.process = subprocess.Popen(
            [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--hide-scrollbars", "--no-proxy-server", f"--user-data-dir={self.profile}", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # its singleton socket's folder (org.chromium.Chromium.*) inside the profile, which is removed after it;
            # in /tmp it outlived every test run (Chromium takes it away only on a clean exit)
            env={**os.environ, "TMPDIR": str(self._tmp())},
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise BrowserError(f"chromium did not open its DevTools port (exit {self.process.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.loop.run_until_complete(self._connect(port))
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.resize(self.width, self.height)
        return self

    def _tmp(self) -> Path:
        folder = self.profile / "tmp"
        folder.mkdir(exist_ok=True)
        return folder

    async def _connect(self, port: int) -> None:
        self.http = aiohttp.ClientSession(trust_env=False)
        async with self.http.get(f"http://127.0.0.1:{port}/json/list") as reply:
            pages = [t for t in await reply.json() if t.get("type") == "page"]
        if not pages:
            raise BrowserError("chromium has no tab")
        self.ws = await self.http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if self.ws is not None:
                await self.ws.close()
            if self.http is not None:
                await self.http.close()

        self.loop.run_until_complete(close())
        self.loop.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- the protocol
    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._call(method, params, timeout))

    async def _call(self, method: str, params: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.ws is not None
        ident = next(self.ids)
        await self.ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
        async with asyncio.timeout(timeout):
            while True:
                message = await self.ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise BrowserError(f"the DevTools connection closed ({message.type})")
                data = json.loads(message.data)
                if data.get("id") == ident:
                    if "error" in data:
                        raise BrowserError(f"{method}: {data['error']}")
                    return data.get("result", {})

    # -- what tests do
    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails'].get('exception', {}).get('description') or result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None  # the page is between documents
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {expression!r} on {self.evaluate('location.href')}")
            time.sleep(0.1)

    def goto(self, url: str, ready: str = "document.readyState === 'complete' && document.body && document.body.dataset.ready === '1'", timeout: float = 60) -> None:
        """Load `url` as a new document and wait until `ready` holds in it (the default: the dashboard's script ran)."""
        self.evaluate("window.__polarOld = true")
        self.call("Page.navigate", url=url)
        self.wait_for(f"!window.__polarOld && ({ready})", timeout)

    def wait_for_page(self, ready: str = "document.readyState === 'complete' && document.body && document.body.dataset.ready === '1'", timeout: float = 60) -> None:
        """After a click that loads another document: wait for it, as goto does."""
        self.wait_for(f"!window.__polarOld && ({ready})", timeout)

    def mark_page(self) -> None:
        """Mark the current document, so wait_for_page can tell the next one from it."""
        self.evaluate("window.__polarOld = true")

    def text(self, selector: str) -> str:
        return self.evaluate(f"(document.querySelector({json.dumps(selector)}) || {{innerText: ''}}).innerText")

    def count(self, selector: str) -> int:
        return self.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length")

    def type_into(self, selector: str, text: str, clear: bool = True) -> None:
        """Focus the field and type as a user would (Input.insertText fires the input events)."""
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); {'e.value = ' + json.dumps('') + ';' if clear else ''} }})()")
        self.call("Input.insertText", text=text)

    def press(self, key: str = "Enter", code: int = 13) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code, nativeVirtualKeyCode=code)

    def _center(self, selector: str) -> tuple[float, float]:
        box = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}}); "
                            "const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        return box[0], box[1]

    def hover(self, selector: str) -> None:
        x, y = self._center(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        x, y = self._center(selector)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def resize(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: Path, height: int | None = None, colors: int = 192) -> Path:
        """A PNG of the viewport (`height`: of that much of the page from its top instead), made small: quantised
        to `colors` colours when Pillow is there (the README shows these)."""
        if height is not None:
            self.evaluate("window.scrollTo(0, 0)")
            self.resize(self.width, height)
        shot = base64.b64decode(self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"])
        if height is not None:
            self.resize(self.width, self.height)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            from PIL import Image

            image = Image.open(io.BytesIO(shot)).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
            image.save(path, optimize=True)
        except ImportError:
            path.write_bytes(shot)
        return path

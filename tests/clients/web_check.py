#!/usr/bin/env python3
"""web_check.py - the router's chat page (GET /) in headless Chromium.

    python3 tests/clients/web_check.py --url http://127.0.0.1:PORT/ --key KEY \
        --model qwen3 --message Hello --want TEXT --shot DIR

Chromium starts through tools/chromium.sh (the project's one way to start
it) with --remote-debugging-pipe: the DevTools protocol on fds 3 (to the
browser) and 4 (from it), NUL-separated JSON. Python's standard library
only. The page is used as a person would: the key typed into its field,
temperature and max tokens typed, the message typed and Enter pressed
(real input events, Input.insertText and Input.dispatchKeyEvent). Checks:

  page_loaded      the page's title, and "enter the API key" before the key
  models_listed    the model picker filled from /v1/models once the key is in
  streamed         the answer grew in the page over several reads (stream)
  answer           the answer's text equals --want (the same request through
                   the API, computed by the C test)
  screenshot       DIR/page.png; inside the answer's box, dark (text) pixels
                   that were not there in DIR/before.png, taken before sending
  csp_blocks       a fetch to another origin is refused by the page's
                   Content-Security-Policy (a securitypolicyviolation event)
  no_console_errors  no console error, exception or error log entry while
                   the page loaded, listed models and streamed the answer

Each check prints "ok NAME" or "FAIL NAME: why" (the C test,
tests/router/test_web.c, counts them). Exit 2 when Chromium is absent.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib

RESULTS = {"ok": 0, "fail": 0}


def check(name, cond, why=""):
    RESULTS["ok" if cond else "fail"] += 1
    print(f"ok {name}" if cond else f"FAIL {name}: {why}", flush=True)


# ==== DevTools over a pipe ====

class Browser:
    def __init__(self):
        to_r, self.to_w = os.pipe()      # we write, Chromium reads fd 3
        self.from_r, from_w = os.pipe()  # Chromium writes fd 4, we read

        def fds():   # in the child: the pipe ends onto 3 and 4 (copied first: they may be 3 or 4 already)
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)
        self.proc = subprocess.Popen(["tools/chromium.sh", "--remote-debugging-pipe", "about:blank"],
                                     preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.buf = b""
        self.next_id = 0
        self.events = []
        self.session = None

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no message from Chromium")
            chunk = os.read(self.from_r, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed the pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method, params=None, session=True, timeout=30.0):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self.events.append(m)

    def wait_event(self, method, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.events):
                if m["method"] == method:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))

    def js(self, expr):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def type_into(self, selector, text, replace=False):
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        if replace:
            self.js(f"document.querySelector({json.dumps(selector)}).select()")
        self.send("Input.insertText", {"text": text})

    def key(self, name, code, vk, text=""):
        for t in ("keyDown", "keyUp"):
            p = {"type": t, "key": name, "code": code, "windowsVirtualKeyCode": vk, "nativeVirtualKeyCode": vk}
            if t == "keyDown" and text:
                p["text"] = text
            self.send("Input.dispatchKeyEvent", p)

    def screenshot(self, path):
        import base64
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    def close(self):
        try:
            self.send("Browser.close", session=False, timeout=5)
        except Exception:  # already gone: the wait below reaps it
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ==== PNG (8-bit RGB or RGBA, not interlaced: what Chromium writes) ====

def png_pixels(data):
    """(width, height, channels, rows of bytes) of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, f"PNG depth {depth} color {color}"
            ch = 4 if color == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, rows, prev = zlib.decompress(idat), w * ch, [], bytearray(w * ch)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - ch] if x >= ch else 0
            b, c = prev[x], prev[x - ch] if x >= ch else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return w, h, ch, rows


def dark_pixels(png, box):
    """Pixels darker than mid-grey inside box (x, y, w, h in CSS pixels = device pixels here)."""
    w, h, ch, rows = png_pixels(png)
    x0, y0 = max(0, int(box["x"])), max(0, int(box["y"]))
    x1, y1 = min(w, int(box["x"] + box["w"])), min(h, int(box["y"] + box["h"]))
    n = 0
    for y in range(y0, y1):
        r = rows[y]
        for x in range(x0, x1):
            i = x * ch
            if r[i] * 299 + r[i + 1] * 587 + r[i + 2] * 114 < 128000:
                n += 1
    return n


# ==== The checks ====

def console_errors(events):
    out = []
    for m in events:
        p = m.get("params", {})
        if m["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description", "")))
                                                               for a in p.get("args", [])))
        elif m["method"] == "Runtime.exceptionThrown":
            out.append("exception: " + p.get("exceptionDetails", {}).get("text", "") + " " +
                       str(p.get("exceptionDetails", {}).get("exception", {}).get("description", "")))
        elif m["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append("log: " + p["entry"].get("text", "") + " " + p["entry"].get("url", ""))
    return out


def poll(b, expr, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = b.js(expr)
        if v:
            return v
        time.sleep(0.05)
    return None


def run(a):
    b = Browser()
    try:
        target = b.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        b.session = b.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        for m in ("Runtime.enable", "Log.enable", "Page.enable"):
            b.send(m)
        b.send("Page.navigate", {"url": a.url})
        b.wait_event("Page.loadEventFired")
        asked = poll(b, "document.getElementById('stat').textContent", 10)
        check("page_loaded", b.js("document.title") == "tandem chat" and asked == "enter the API key",
              f"title {b.js('document.title')!r}, status {asked!r}")

        b.type_into("#key", a.key)
        b.type_into("#in", "")   # leaving the field commits the key (its change event)
        models = poll(b, "[...document.getElementById('model').options].map(o => o.value).join(',')", 10)
        check("models_listed", models and a.model in models.split(","), f"picker {models!r}")
        b.js(f"document.getElementById('model').value = {json.dumps(a.model)}")
        b.type_into("#temp", "0", replace=True)
        b.type_into("#maxtok", str(a.max_tokens), replace=True)

        before = b.screenshot(os.path.join(a.shot, "before.png"))
        # The page records each text the answer shows while busy: a small
        # model streams 32 tokens faster than DevTools round trips can poll,
        # while an observer sees every change the page makes between reads.
        b.js("""window.seenBusy = new Set(); new MutationObserver(() => {
            const t = (document.querySelector('.assistant') || {}).textContent || '';
            if (document.body.dataset.state === 'busy' && t) window.seenBusy.add(t);
          }).observe(document.getElementById('msgs'), {subtree: true, childList: true, characterData: true}); 1""")
        b.type_into("#in", a.message)
        b.key("Enter", "Enter", 13, "\r")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = b.js("document.body.dataset.state")
            if st == "idle" and b.js("document.querySelectorAll('.assistant i').length") > 0:
                break
            time.sleep(0.01)
        seen = b.js("[...window.seenBusy]")
        answer = b.js("(document.querySelector('.assistant').firstChild || {}).nodeValue || ''")
        chunks = b.js("Number(document.querySelector('.assistant i').dataset.chunks)")
        check("streamed", len(seen) >= 2 and chunks >= 2,
              f"{len(seen)} partial texts seen while busy, {chunks} chunks")
        check("answer", answer == a.want, f"page {answer!r}, API {a.want!r}")

        after = b.screenshot(os.path.join(a.shot, "page.png"))
        box = b.js("(r => ({x: r.x, y: r.y, w: r.width, h: r.height}))"
                   "(document.querySelector('.assistant').getBoundingClientRect())")
        d0, d1 = dark_pixels(before, box), dark_pixels(after, box)
        check("screenshot", d1 >= 50 and d1 > 10 * (d0 + 1),
              f"{d1} dark pixels in the answer's box {box} after, {d0} before")
        errs = console_errors(b.events)
        check("no_console_errors", not errs, "; ".join(errs)[:1500])

        blocked = b.js("""new Promise(res => {
            document.addEventListener('securitypolicyviolation', e => res(e.violatedDirective), {once: true});
            fetch('http://192.0.2.1/x').catch(() => {});
            setTimeout(() => res(''), 3000); })""")
        check("csp_blocks", blocked == "connect-src", f"violated directive {blocked!r}")
    finally:
        b.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--message", required=True)
    ap.add_argument("--want", required=True, help="the answer the API gives to the same request")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--shot", required=True, help="folder for before.png and page.png")
    a = ap.parse_args()
    if not shutil.which(os.environ.get("CHROMIUM", "chromium")) and not shutil.which("chromium-browser"):
        print("chromium not found", flush=True)
        return 2
    try:
        run(a)
    except Exception as e:  # the failure is the report
        check("browser", False, f"{type(e).__name__}: {e}")
    print(f"# web: {RESULTS['ok']} ok, {RESULTS['fail']} failed", flush=True)
    return 1 if RESULTS["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())

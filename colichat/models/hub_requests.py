"""Every request colichat makes to the Hugging Face Hub (hub.py), watched while it waits:

    with watched(said):        # said: hints.Said, the lines said once
        ...                    # the hub's client's requests

- each has a connect and a read timeout: the hub's own where it sets one (HF_HUB_ETAG_TIMEOUT,
  HF_HUB_DOWNLOAD_TIMEOUT), else COLICHAT_HUB_TIMEOUT seconds (TIMEOUT);
- one not answered after COLICHAT_HUB_WAIT seconds (WAIT) says what it waits for, once (a status line);
- one that timed out is not sent again (the hub's client would retry it five times, for minutes): the
  next try raises HubSilent, which hub.py says as one line.
It works through the hub's client's event hooks (httpx's, a public interface): a request hook before
each request is sent, a response hook once the head of its answer arrives.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from urllib.parse import unquote

from ..hints import Said

TIMEOUT = 30.0  # s a request waits to connect, and for each answer, where the hub sets none
WAIT = 5.0  # s before a request not answered yet says what it waits for


class HubSilent(Exception):
    """A request to the hub that was not answered within its timeout: not sent again."""


class Watch:
    """Every request to the hub while colichat waits on it: its timeouts where the hub set none, a line
    saying what it waits for once a request is not answered after WAIT s, and no second try of a request
    that timed out (the hub's client retries one; the hub is taken as not answering). It works through
    the hub's client's event hooks (httpx's): a request hook before each request, a response hook once
    its answer's head arrives."""

    def __init__(self, said: Said):
        self.said = said
        self.timeout = _seconds("COLICHAT_HUB_TIMEOUT", TIMEOUT)
        self.wait = _seconds("COLICHAT_HUB_WAIT", WAIT)
        self.started: dict[tuple, float] = {}  # (method, url) -> when its last try was sent, until answered
        self.timers: dict[tuple, threading.Timer] = {}

    def request(self, request) -> None:
        key, now = (request.method, str(request.url)), time.monotonic()
        given = request.extensions.get("timeout") or {}
        timeout = {k: self.timeout if given.get(k) is None else given[k] for k in ("connect", "read", "write", "pool")}
        started = self.started.get(key)
        if started is not None and now - started >= min(timeout["connect"], timeout["read"]):
            self.stop()
            raise HubSilent(f"the Hugging Face Hub at {request.url.scheme}://{request.url.netloc.decode()} did not "
                            f"answer in {timeout['read']:g} s ({_what(request)}); check the network connection "
                            "(a model already downloaded starts without one)")
        request.extensions["timeout"] = timeout
        self.started[key] = now
        self._cancel(key)
        line = f"waiting for the Hugging Face Hub at {request.url.host} to answer: {_what(request)} ..."
        timer = self.timers[key] = threading.Timer(self.wait, self.said, (key, line))
        timer.daemon = True
        timer.start()

    def response(self, response) -> None:
        key = (response.request.method, str(response.request.url))
        self.started.pop(key, None)
        self._cancel(key)

    def _cancel(self, key) -> None:
        timer = self.timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def stop(self) -> None:
        for key in list(self.timers):
            self._cancel(key)


@contextmanager
def watched(said: Said):
    """The hub's client watched (Watch) while the block runs."""
    from huggingface_hub.utils import get_session

    session, watch = get_session(), Watch(said)
    hooks = session.event_hooks
    session.event_hooks = {"request": [*hooks["request"], watch.request],
                           "response": [*hooks["response"], watch.response]}
    try:
        yield
    finally:
        watch.stop()
        session.event_hooks = hooks


def _seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable `name`, else `default`."""
    text = os.environ.get(name, "").strip()
    if not re.fullmatch(r"\d{1,6}(\.\d{0,3})?", text):
        return default
    return float(text) if float(text) > 0 else default


def _what(request) -> str:
    """What a request to the hub asks for, in words."""
    path = unquote(request.url.path)
    if path == "/api/agent-harnesses":
        return "its list of agent harnesses"
    tree = re.match(r"^/api/models/([^/]+/[^/]+)/tree/", path)
    if tree:
        return f"the list of files of {tree[1]}"
    resolve = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
    if resolve:
        part = " (its header)" if "Range" in request.headers and request.method == "GET" else ""
        return f"{resolve[2]} of {resolve[1]}{part}"
    return f"{request.method} {path}"

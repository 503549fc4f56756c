"""The front door's decisions, kept pure so tests can table-drive them: whether a sign-in post
comes from another site, whether an address has failed to sign in too often, which rows of a
long history an answer carries, and one read shared by everyone who asks within a moment."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None] | None:
    """(host, port) of ``netloc`` with the scheme's default port filled in; None when it is no address."""
    try:
        parts = urlsplit(f"//{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname.lower(), port if port is not None else DEFAULT_PORTS.get(scheme)


def cross_site_refusal(headers: Mapping[str, str]) -> str | None:
    """Why a form post must be refused as cross-site, or None when it comes from this site.

    Browsers say where a post comes from. ``Sec-Fetch-Site``, where sent, decides alone: only
    ``same-origin`` (or ``none``: typed by the user) passes; our own page's posts carry ``Origin:
    null``, as its ``Referrer-Policy: no-referrer`` makes browsers send, so Origin cannot decide for
    a browser that says more. Without it, ``Origin`` when present must name this very host and port
    (``Host``; a Host without a port takes the Origin scheme's, as behind a TLS proxy). A client
    that sends neither (curl, a script) is not a browser another site can drive, so it passes."""
    site = (headers.get("sec-fetch-site") or "").strip().lower()
    if site in ("same-origin", "none"):
        return None
    if site:
        return (f"a sign-in posted from another site (Sec-Fetch-Site: {site[:20]}) is refused: sign in on this "
                "service's own page")
    origin = headers.get("origin")
    if origin is None:
        return None
    host = headers.get("host") or ""
    parts = urlsplit(origin.strip())
    origin_at = _host_port(parts.netloc, parts.scheme) if parts.scheme in DEFAULT_PORTS else None
    if origin_at is None or origin_at != _host_port(host, parts.scheme):
        shown = origin[:100]
        return (f"a sign-in posted from origin {shown!r} is refused: only this service's own page ({host[:100]}) "
                "may post it")
    return None


class LoginLimiter:
    """Failed sign-ins per client address over a sliding window, in memory and bounded: at most
    ``max_addresses`` addresses are remembered, the least recently seen forgotten first, so an
    attacker with many addresses cannot grow it (and each of them still gets only ``max_failures``)."""

    def __init__(self, max_failures: int, window_s: float, max_addresses: int,
                 clock: Callable[[], float] = time.monotonic):
        self.max_failures, self.window_s, self.max_addresses, self.clock = max_failures, window_s, max_addresses, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after_s(self, address: str) -> int | None:
        """Whole seconds until ``address`` may try again, or None when it may now."""
        with self._lock:
            times = self._recent(address)
            if times is None or len(times) < self.max_failures:
                return None
            return max(1, math.ceil(times[0] + self.window_s - self.clock()))

    def failed(self, address: str) -> None:
        with self._lock:
            times = self._recent(address)
            if times is None:
                times = self._failures[address] = deque(maxlen=self.max_failures)
                while len(self._failures) > self.max_addresses:
                    self._failures.popitem(last=False)
            times.append(self.clock())
            self._failures.move_to_end(address)

    def _recent(self, address: str) -> deque[float] | None:
        """The address's failures still inside the window (it is forgotten when none are)."""
        times = self._failures.get(address)
        if times is None:
            return None
        horizon = self.clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times


def downsample(rows: Sequence[T], max_points: int) -> list[T]:
    """At most ``max_points`` (2 or more) rows, evenly spaced, the first and the last always among them."""
    n = len(rows)
    if n <= max_points:
        return list(rows)
    return [rows[round(i * (n - 1) / (max_points - 1))] for i in range(max_points)]


class SharedRead:
    """One read per key per ``ttl_s``, however many threads ask at once: the first reads, the
    others wait for its answer (or its error) instead of reading again. Bounded in keys."""

    def __init__(self, ttl_s: float, max_keys: int = 1024, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_keys, self.clock = ttl_s, max_keys, clock
        self._entries: OrderedDict[Any, tuple[float, bool, Any]] = OrderedDict()  # key -> (at, ok, value)
        self._locks: dict[Any, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, read: Callable[[], T]) -> T:
        with self._lock:
            key_lock = self._locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                entry = self._entries.get(key)
            if entry is None or self.clock() - entry[0] >= self.ttl_s:
                try:
                    entry = (self.clock(), True, read())
                except Exception as exc:  # boundary: the reader's error is everyone's answer for this moment
                    entry = (self.clock(), False, exc)
                with self._lock:
                    self._entries[key] = entry
                    self._entries.move_to_end(key)
                    # Oldest first: drop what is past its moment (nobody would use it; it holds memory), then
                    # the oldest beyond max_keys.
                    while self._entries and (len(self._entries) > self.max_keys or
                                             self.clock() - next(iter(self._entries.values()))[0] >= self.ttl_s):
                        old, _ = self._entries.popitem(last=False)
                        self._locks.pop(old, None)
        _, ok, value = entry
        if not ok:
            raise value
        return value

"""A work queue of object keys with per-key exponential backoff, and list/watch feeders.

What client-go's informers and rate-limited queues do, in the small: a key is queued once
however often it is added; a failed key comes back after 1 s, 2 s, 4 s ... up to 5 minutes;
a watch that ends (the server closes it every few minutes) is renewed from the last
resourceVersion it saw (bookmarks included); one that answers 410 Gone (the resourceVersion
is too old) or fails is replaced by a fresh list, never dropped, and every key listed is
queued again (a key waiting out its backoff keeps waiting), so nothing that changed while no
watch ran is missed. A key is handed to one worker at a time.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

LOG = logging.getLogger(__name__)

__all__ = ["WorkQueue", "watch_forever"]

FIRST_RETRY = 1.0
MAX_RETRY = 300.0
#: How long one watch request may stay open before it is renewed (the server's own limit is
#: about 5-10 minutes; a stuck connection must not hide changes longer than this).
WATCH_SECONDS = 240


class WorkQueue:
    """Keys to sync, each at most once in the queue, each with its own backoff."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, str]] = []
        self._due: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._counter = 0
        #: keys handed out by :meth:`get` and not yet :meth:`done`: never handed out twice
        self._active: set[str] = set()
        #: when an active key was added again: queued at :meth:`done`
        self._pending: dict[str, float] = {}
        self._cond = threading.Condition()

    def add(self, key: str, delay: float = 0.0) -> None:
        """Queue ``key`` to run after ``delay`` seconds (sooner if already queued sooner)."""
        with self._cond:
            self._add(key, self._clock() + delay)

    def _add(self, key: str, due: float) -> None:
        if key in self._active:
            if key not in self._pending or due < self._pending[key]:
                self._pending[key] = due
            return
        if key in self._due and self._due[key] <= due:
            return
        self._due[key] = due
        self._counter += 1
        heapq.heappush(self._heap, (due, self._counter, key))
        self._cond.notify()

    def add_listed(self, key: str) -> None:
        """Queue ``key`` now unless it is queued (or running) already: what a (re)list
        adds, so that a key waiting out its backoff keeps waiting."""
        with self._cond:
            if key in self._due or key in self._active or key in self._pending:
                return
            self._add(key, self._clock())

    def done(self, key: str) -> None:
        """A worker finished ``key``: it may be handed out again (now, if it was added
        meanwhile)."""
        with self._cond:
            self._active.discard(key)
            due = self._pending.pop(key, None)
            if due is not None:
                self._add(key, due)

    def retry(self, key: str, at_least: float = 0.0) -> float:
        """Queue ``key`` again after its next backoff step; return that delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = float(max(at_least, min(MAX_RETRY, FIRST_RETRY * (2**failures))))
        self.add(key, delay)
        return delay

    def forget(self, key: str) -> None:
        """The key synced: its backoff starts over."""
        with self._cond:
            self._failures.pop(key, None)

    def get(self, timeout: float | None = None) -> str | None:
        """The next due key (removed from the queue), or None after ``timeout``."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                while self._heap and self._due.get(self._heap[0][2]) != self._heap[0][0]:
                    heapq.heappop(self._heap)  # superseded by an earlier add
                now = self._clock()
                if self._heap and self._heap[0][0] <= now:
                    _, _, key = heapq.heappop(self._heap)
                    del self._due[key]
                    self._active.add(key)
                    return key
                wait = self._heap[0][0] - now if self._heap else None
                if deadline is not None:
                    left = deadline - now
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def __len__(self) -> int:
        with self._cond:
            return len(self._due) + len(self._pending)


def watch_forever(
    list_fn: Callable[..., Any],
    on_key: Callable[[str, dict[str, Any] | None], None],
    key_of: Callable[[Any], str],
    stop: threading.Event,
    what: str,
    stream: Callable[..., Iterator[dict[str, Any]]] | None = None,
    **list_args: Any,
) -> None:
    """List, then watch from the list's resourceVersion, calling ``on_key(key, event)`` for
    every object listed and every event; re-list on 410 Gone, on a watch's end and after an
    error (with backoff). Returns only when ``stop`` is set."""
    from kubernetes import watch
    from kubernetes.client.rest import ApiException

    backoff = FIRST_RETRY
    version = ""  # the last resourceVersion seen: "" lists (again) before the next watch
    while not stop.is_set():
        try:
            if not version:
                listed = list_fn(**list_args, _request_timeout=60)
                for item in listed.items:
                    on_key(key_of(item), None)
                version = listed.metadata.resource_version
            watcher = watch.Watch()
            events = (stream or watcher.stream)(
                list_fn,
                resource_version=version,
                timeout_seconds=WATCH_SECONDS,
                allow_watch_bookmarks=True,
                _request_timeout=WATCH_SECONDS + 30,
                **list_args,
            )
            backoff = FIRST_RETRY
            for event in events:
                if stop.is_set():
                    watcher.stop()
                    return
                kind = event.get("type")
                if kind == "ERROR":
                    raw = event.get("raw_object") or {}
                    version = ""
                    if raw.get("code") == 410:
                        LOG.info("%s watch: resourceVersion too old, listing again", what)
                        break
                    raise RuntimeError(f"watch error: {raw.get('message', raw)}")
                version = _version_of(event) or version
                if kind == "BOOKMARK":
                    continue
                on_key(key_of(event["object"]), event)
            # a watch that ended (its timeout) is renewed from the last version seen: no
            # relist, so the cost of a quiet cluster is one request per WATCH_SECONDS
        except ApiException as exc:
            version = ""
            if exc.status == 410:
                LOG.info("%s watch: 410 Gone, listing again", what)
                continue
            LOG.warning(
                "%s list/watch failed (%s %s); again in %.0f s",
                what,
                exc.status,
                exc.reason,
                backoff,
            )
            stop.wait(backoff)
            backoff = min(MAX_RETRY, backoff * 2)
        except Exception as exc:
            version = ""
            LOG.warning("%s list/watch failed (%s); again in %.0f s", what, exc, backoff)
            stop.wait(backoff)
            backoff = min(MAX_RETRY, backoff * 2)


def _version_of(event: Mapping[str, Any]) -> str:
    """The resourceVersion of a watch event's object (a model or, for bookmarks, a dict)."""
    obj = event.get("object")
    if obj is None:
        obj = event.get("raw_object") or {}
    meta = obj.get("metadata") if isinstance(obj, dict) else getattr(obj, "metadata", None)
    if meta is None:
        return ""
    found = meta.get("resourceVersion") if isinstance(meta, dict) else meta.resource_version
    return str(found or "")

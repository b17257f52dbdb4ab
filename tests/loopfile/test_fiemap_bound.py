"""The FIEMAP walk of the room accounts (loopfile's _extents, the iSCSI target host's
_lio_room) stops at a bound (``WALK_FACTOR`` x the shared extents still remembered +
``FIRST_WALK``) and counts the file's sharing as unknown past it: a file with millions of
unshared extents (a tenant writing every other block of its sparse volume) is never walked to
its end under the room lock (loopfile: every mount that creates or grows a file; the target
host: every provisioning call holds /run/flexhub-lio.lock meanwhile). Found by a hostile
review (2026-12-06): the walk was bounded by the shared extents alone."""

from __future__ import annotations

import fcntl
import struct
from collections.abc import Callable
from typing import Any

import pytest
from flexhub_iscsi import _lio_room
from flexhub_loopfile import _extents

_HEAD = struct.Struct("=QQIIII")
_EXTENT = struct.Struct("=QQQ16xI12x")
#: What a tenant can leave: 64 Mi unshared 4 KiB extents (a fragmented 512 GiB file).
EXTENTS = 64 << 20
BLOCK = 4096


class Walked(BaseException):
    """The scan went far past any reasonable bound."""


def fragmented(batch: int, stop_after: int) -> tuple[Callable[..., Any], list[int]]:
    """A fake FS_IOC_FIEMAP over a file of EXTENTS unshared, non-contiguous extents."""
    calls: list[int] = []

    def ioctl(fd: int, request: int, buffer: Any, *rest: Any) -> int:
        calls.append(1)
        if len(calls) > stop_after:
            raise Walked(f"{len(calls)} FIEMAP calls, {len(calls) * batch} extents read")
        start = _HEAD.unpack_from(buffer, 0)[0]
        first = start // (2 * BLOCK)
        count = min(batch, EXTENTS - first)
        for i in range(count):
            n = first + i
            flags = 0x1 if n == EXTENTS - 1 else 0
            _EXTENT.pack_into(
                buffer, _HEAD.size + i * _EXTENT.size, 2 * BLOCK * n, 8 * BLOCK * n, BLOCK, flags
            )
        head = list(_HEAD.unpack_from(buffer, 0))
        head[3] = count
        _HEAD.pack_into(buffer, 0, *head)
        return 0

    return ioctl, calls


@pytest.mark.parametrize(
    "module, batch, limit",
    [(_extents, _extents.BATCH, 100_000), (_lio_room, _lio_room.FIEMAP_BATCH, 100_000)],
    ids=["loopfile", "iscsi"],
)
def test_a_file_with_millions_of_unshared_extents_is_not_walked_to_its_end(
    monkeypatch: pytest.MonkeyPatch, module: Any, batch: int, limit: int
) -> None:
    # a generous bound: ten times the extents the shared cap (MAX_SHARED) lets be remembered
    bound = 10 * limit // batch
    ioctl, calls = fragmented(batch, stop_after=bound)
    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    try:
        result = module.shared_extents(3, limit)
    except Walked as exc:
        pytest.fail(f"unbounded FIEMAP walk: {exc} (of {EXTENTS} unshared extents)")
    # past a bound the account must stay on the safe side (None: 'sharing unknown')
    assert result is None or result == []
    assert len(calls) <= bound

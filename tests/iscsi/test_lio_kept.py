"""The provisioner's kept connection to a target host (:mod:`flexhub_iscsi._lio_ssh`), with
the real remote program and loader run by this host's python in place of ``ssh`` (the VM
tests run it over ssh against LIO): requests over one connection, a connection that ended or
refused never reused, a hung one killed within the request's bound, the key files gone once
the connection answered, and the program's own idle limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flexhub_iscsi import _lio, _lio_ssh

from flexhub.errors import FlexhubError
from flexhub.node import live as live_module
from flexhub.node.runner import SubprocessRunner
from tests.iscsi.test_lio_capacity import spec_of
from tests.iscsi.test_lio_snapshots import luns  # noqa: F401 (the fixture)
from tests.iscsi.test_provision import KEY, secrets

#: The loader as the target host's shell hands it to python3 (its quotes removed).
LOADER = _lio.REMOTE_COMMAND[3].strip("'")
SSH = _lio.Ssh("10.0.0.5", "root", 22)


class Local(SubprocessRunner):
    """Production's runner; each ``ssh`` it is asked to start runs the loader here instead,
    and what was started (and the key files it was given) is recorded."""

    def __init__(self, program: list[str] | None = None) -> None:
        super().__init__(timeout=30)
        self.started: list[Any] = []
        self.key_dirs: list[str] = []
        self.program = program or [sys.executable, "-I", "-c", LOADER]

    def spawn(self, argv: Any, **kwargs: Any) -> Any:
        assert argv[-4:] == list(_lio.REMOTE_COMMAND)
        key_file = next(a.split("=", 1)[1] for a in argv if a.startswith("IdentityFile="))
        assert Path(key_file).read_text() == KEY and os.stat(key_file).st_mode & 0o077 == 0
        self.key_dirs.append(os.path.dirname(key_file))
        live = super().spawn(self.program, **kwargs)
        self.started.append(live)
        return live


@pytest.fixture(autouse=True)
def kept() -> Iterator[None]:
    _lio_ssh.KEPT_CONNECTIONS.close_all()
    yield
    _lio_ssh.KEPT_CONNECTIONS.close_all()


def ended(live: Any, within: float = 20.0) -> int | None:
    """``live``'s exit status once it has ended and been reaped (``None``: not within)."""
    deadline = time.monotonic() + within
    while live.returncode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return live.returncode  # type: ignore[no-any-return]


def lio(runner: Local) -> _lio_ssh.Lio:
    return _lio_ssh.Lio(runner, SSH, secrets())


def test_requests_share_one_connection_and_its_key_files_are_gone_once_it_answered(
    luns: Path,  # noqa: F811
) -> None:
    runner = Local()
    first = lio(runner).call("room", spec_of(luns), [])
    assert first["available"] > 0
    assert not os.path.exists(runner.key_dirs[0])  # removed, the connection still up
    (live,) = runner.started
    assert live.alive()
    (luns / "x.img").write_bytes(b"\1" * (1 << 20))
    second = lio(runner).call("room", spec_of(luns), [])
    assert second["available"] == first["available"] - (1 << 20)  # asked again, not cached
    assert len(runner.started) == 1 and live.alive()
    # another key (a rotated Secret) is another connection
    other = _lio_ssh.Lio(runner, SSH, secrets(**{"ssh-privatekey": KEY + "# rotated\n"}))
    with pytest.raises(AssertionError):  # Local checks the key it was given: not KEY
        other.call("room", spec_of(luns), [])
    _lio_ssh.KEPT_CONNECTIONS.close_all()
    assert live.returncode == 0  # stdin closed: the program ended on its own


def test_a_refusal_ends_the_connection_and_the_next_request_opens_another(
    luns: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    runner = Local()
    with pytest.raises(FlexhubError, match=r"\(room\): .*No such file"):
        lio(runner).call("room", spec_of(tmp_path / "missing"), [])
    (refused,) = runner.started
    assert refused.returncode == 3  # the program ended after its refusal
    assert lio(runner).call("room", spec_of(luns), [])["available"] > 0
    assert len(runner.started) == 2


def test_a_kept_connection_that_ended_is_asked_again_over_a_new_one(
    luns: Path,  # noqa: F811
) -> None:
    runner = Local()
    lio(runner).call("room", spec_of(luns), [])
    (first,) = runner.started
    os.kill(first.pid, 9)  # the connection drops while it is kept
    first.proc.wait()
    assert lio(runner).call("room", spec_of(luns), [])["available"] > 0
    assert len(runner.started) == 2


def test_a_connection_that_gives_no_answer_is_killed_within_the_bound() -> None:
    # a "target host" that reads everything and never answers
    silent = [
        sys.executable,
        "-I",
        "-c",
        "import sys, time\nsys.stdin.buffer.read()\ntime.sleep(60)",
    ]
    runner = Local(silent)
    started = time.monotonic()
    with pytest.raises(
        FlexhubError, match=r"iscsi: target host 10\.0\.0\.5: .*no answer within 2s"
    ):
        lio(runner).call("room", {"directory": "/srv"}, [], timeout=2)
    assert time.monotonic() - started < 10
    (live,) = runner.started
    assert live.returncode == -9  # killed, reaped, never kept
    assert not os.path.exists(runner.key_dirs[0])
    assert _lio_ssh.KEPT_CONNECTIONS.idle == {}  # nothing kept, for any target


def test_connections_idle_too_long_are_closed_not_reused(
    luns: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = Local()
    lio(runner).call("room", spec_of(luns), [])
    monkeypatch.setattr(_lio_ssh, "IDLE", 0.0)
    time.sleep(0.05)
    lio(runner).call("room", spec_of(luns), [])
    first, second = runner.started
    assert ended(first) == 0 and second.alive()  # closed (on a thread of its own)


def test_concurrent_requests_each_have_a_connection_and_at_most_kept_stay(
    luns: Path,  # noqa: F811
) -> None:
    runner = Local()
    answers: list[int] = []

    def ask() -> None:
        answers.append(lio(runner).call("room", spec_of(luns), [])["available"])

    threads = [threading.Thread(target=ask) for _ in range(_lio_ssh.KEPT + 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == len(threads) and len(set(answers)) == 1
    kept = [live for lives in _lio_ssh.KEPT_CONNECTIONS.idle.values() for _, live in lives]
    assert len(kept) <= _lio_ssh.KEPT
    assert all(live.alive() for live in kept)
    assert all(live.returncode == 0 for live in runner.started if live not in kept)


def test_the_program_ends_by_itself_when_no_request_comes() -> None:
    program = _lio_ssh.remote_program().replace("\nIDLE = 120\n", "\nIDLE = 1\n", 1)
    assert "\nIDLE = 1\n" in program
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", LOADER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None
    proc.stdin.write(f"{len(program)}\n{program}".encode("ascii"))
    proc.stdin.flush()  # stdin stays open: only the idle limit can end it
    try:
        assert proc.wait(15) == -14  # SIGALRM
    finally:
        proc.kill()
        proc.wait()


def test_a_connection_past_its_lifetime_gets_no_more_requests(
    luns: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An open SSH connection outlives its key being revoked on the target host: none is used
    past :data:`~flexhub_iscsi._lio_ssh.LIFETIME`, however busy."""
    runner = Local()
    lio(runner).call("room", spec_of(luns), [])
    monkeypatch.setattr(_lio_ssh, "LIFETIME", 0.0)
    lio(runner).call("room", spec_of(luns), [])
    first, second = runner.started
    assert ended(first) == 0 and second.alive()  # closed (on a thread of its own)


def test_a_retry_waits_for_the_lock_only_as_long_as_its_caller_still_waits(
    luns: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept connection that ends without answering is asked again with the lock's wait
    of the time left (less the margin), or not at all when too little is left: a request is
    never run on the target host after its caller gave up."""
    sent: list[dict[str, Any]] = []
    real_line, real_exchange = _lio_ssh.request_line, _lio_ssh.Lio._exchange
    clock = [1000.0]
    dies_after = [0.0]

    def recorded(request: Any) -> str:
        sent.append(dict(request))
        return real_line(request)

    def kept_dies(self: Any, live: Any, data: bytes, *args: Any) -> Any:
        if live is runner.started[0]:  # the kept one: the connection drops after a while
            os.kill(live.pid, 9)
            live.proc.wait()
            clock[0] += dies_after[0]
        return real_exchange(self, live, data, *args)

    runner = Local()
    lio(runner).call("room", spec_of(luns), [])
    monkeypatch.setattr(_lio_ssh, "request_line", recorded)
    monkeypatch.setattr(_lio_ssh.Lio, "_exchange", kept_dies)
    monkeypatch.setattr(_lio_ssh.time, "monotonic", lambda: clock[0])
    # too late to ask again: it died with no more than the margin (and 1 s) left
    dies_after[0] = 100 - _lio.LOCK_MARGIN - 1
    with pytest.raises(FlexhubError, match=r"\(room\): a kept connection ended without answering"):
        lio(runner).call("room", spec_of(luns), [], timeout=100)
    assert len(runner.started) == 1 and len(sent) == 1  # nothing sent again
    assert sent[0]["wait"] == 100 - _lio.LOCK_MARGIN
    # early enough: asked again over a new connection, the lock's wait what is left less
    # the margin
    monkeypatch.undo()
    runner = Local()
    lio(runner).call("room", spec_of(luns), [])
    monkeypatch.setattr(_lio_ssh, "request_line", recorded)
    monkeypatch.setattr(_lio_ssh.Lio, "_exchange", kept_dies)
    monkeypatch.setattr(_lio_ssh.time, "monotonic", lambda: clock[0])
    sent.clear()
    dies_after[0] = 40
    assert lio(runner).call("room", spec_of(luns), [], timeout=100)["available"] > 0
    assert len(runner.started) == 2
    assert [r["wait"] for r in sent] == [100 - _lio.LOCK_MARGIN, 100 - 40 - _lio.LOCK_MARGIN]


def test_kept_connections_are_closed_soon_after_their_idle_time_even_with_no_request(
    luns: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_lio_ssh, "SWEEP", 0.1)
    monkeypatch.setattr(_lio_ssh, "IDLE", 0.3)
    runner = Local()
    lio(runner).call("room", spec_of(luns), [])
    (live,) = runner.started
    assert ended(live) == 0  # closed (stdin ended) and reaped: no zombie
    assert _lio_ssh.KEPT_CONNECTIONS.idle == {}
    time.sleep(0.3)
    assert not _lio_ssh.KEPT_CONNECTIONS.sweeping  # the sweeper ended with the pool


#: A "target host" speaking the loader's protocol: the program's length and text read and
#: ignored, then one answer per request line. The first request is answered twice (the second
#: time late, as a confused program might) and gets a CHAP value on stderr; a request for
#: ``room`` of ``/die`` ends the program unanswered; ``stay`` keeps it running after its
#: stdin ends.
FAKE = r"""
import json, os, signal, sys, threading, time
b = sys.stdin.buffer
b.read(int(b.readline()))
first = True
for raw in b:
    request = json.loads(raw)
    if request["spec"].get("directory") == "/die":
        sys.exit(1)
    answer = {"id": request["id"], "ok": {"available": 7 if first else 8}}
    print("FLEXHUB-LIO " + json.dumps(answer), flush=True)
    if first:
        sys.stderr.write("warning: chap=Chap-Secret-41xZ\n"); sys.stderr.flush()
        time.sleep(0.3)
        print("FLEXHUB-LIO " + json.dumps({**answer, "ok": {"available": 1}}), flush=True)
    first = False
if os.environ.get("STAY") or "stay" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
"""


def test_an_answer_to_another_request_is_never_taken_and_earlier_stderr_is_not_this_error() -> None:
    runner = Local([sys.executable, "-I", "-c", FAKE])
    assert lio(runner).call("room", {"directory": "/a"}, [])["available"] == 7
    time.sleep(0.6)  # the first request's late second answer is in the pipe
    assert lio(runner).call("room", {"directory": "/b"}, [])["available"] == 8
    assert len(runner.started) == 1
    with pytest.raises(FlexhubError) as refused:
        lio(runner).call("room", {"directory": "/die"}, [], timeout=30)
    assert "Chap-Secret-41xZ" not in refused.value.message  # stderr of an earlier request
    assert "kept connection ended without answering" in refused.value.message


#: A "target host" that writes a request's stderr late: after its answer, while the next
#: request runs, which then fails.
LATE_STDERR = r"""
import json, sys, time
b = sys.stdin.buffer
b.read(int(b.readline()))
raw = b.readline()
print("FLEXHUB-LIO " + json.dumps({"id": json.loads(raw)["id"], "ok": {"available": 7}}), flush=True)
b.readline()  # the next request: the first one's stderr comes now, then the program ends
time.sleep(0.3)
sys.stderr.write("warning: chap=Chap-Secret-77aQ\n"); sys.stderr.flush()
time.sleep(0.3)
sys.exit(1)
"""


def test_stderr_of_an_earlier_request_arriving_during_a_later_one_is_masked_with_its_values() -> (
    None
):
    """The second request masks nothing of its own; the first request's value, in the
    stderr that arrives during the second, is masked all the same."""
    runner = Local([sys.executable, "-I", "-c", LATE_STDERR])
    first = lio(runner).call("room", {"directory": "/a"}, ["Chap-Secret-77aQ"])
    assert first["available"] == 7
    with pytest.raises(FlexhubError) as refused:
        lio(runner).call("room", {"directory": "/b"}, [], timeout=30)
    assert len(runner.started) == 1  # 30 s: too little left to ask again over a new one
    assert "kept connection ended without answering" in refused.value.message
    assert "Chap-Secret-77aQ" not in refused.value.message
    assert "chap=***" in refused.value.message  # the late stderr is there, masked


#: A "target host" whose refusal of the second request names the first request's value.
ECHOING = r"""
import json, sys
b = sys.stdin.buffer
b.read(int(b.readline()))
first = json.loads(b.readline())
print("FLEXHUB-LIO " + json.dumps({"id": first["id"], "ok": {"available": 7}}), flush=True)
second = json.loads(b.readline())
error = "refused: still holding chap=Chap-Secret-55bW"
print("FLEXHUB-LIO " + json.dumps({"id": second["id"], "error": error}), flush=True)
"""


def test_a_refusal_over_a_kept_connection_is_masked_with_every_request_s_values() -> None:
    runner = Local([sys.executable, "-I", "-c", ECHOING])
    assert lio(runner).call("room", {"directory": "/a"}, ["Chap-Secret-55bW"])["available"] == 7
    with pytest.raises(FlexhubError) as refused:
        lio(runner).call("room", {"directory": "/b"}, [], timeout=30)
    assert len(runner.started) == 1
    assert "refused: still holding chap=***" in refused.value.message


def test_closing_stale_connections_takes_none_of_another_request_s_time(
    luns: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept connection to an unreachable host may take seconds to close: a request to
    another host does not wait for it."""
    stays = Local([sys.executable, "-I", "-c", FAKE, "stay"])
    lio(stays).call("room", {"directory": "/a"}, [])
    (stuck,) = stays.started
    monkeypatch.setattr(_lio_ssh, "IDLE", 0.0)
    monkeypatch.setattr(_lio_ssh, "SWEEP", 60.0)
    monkeypatch.setattr(live_module, "_CLOSE_WAIT", 10.0)  # its close waits 10 s, then kills
    elsewhere = _lio_ssh.Lio(Local(), _lio.Ssh("10.0.0.6", "root", 22), secrets())
    assert elsewhere.call("room", spec_of(luns), [])["available"] > 0
    assert stuck.returncode is None  # the request did not wait for its close
    assert ended(stuck, within=30) == -9  # closed all the same: killed once it would not end

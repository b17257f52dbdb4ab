"""A command kept up between bounded exchanges (:class:`flexhub.node.live.LiveCommand`, started
by :meth:`flexhub.node.runner.SubprocessRunner.spawn`), with real processes."""

from __future__ import annotations

import os
import sys
import time

import pytest

from flexhub.errors import CommandError, CommandTimeout
from flexhub.node.live import LiveCommand
from flexhub.node.runner import SubprocessRunner

RUNNER = SubprocessRunner(timeout=10)
MARK = b"ANSWER "

#: Answers each line it reads with ``ANSWER <line>``; ``twice`` answers twice; ``quiet``
#: closes stdout and goes on living; ``fork`` starts a child that outlives it in its group.
SERVER = r"""
import os, sys, time
for line in sys.stdin.buffer:
    word = line.strip().decode()
    if word == "twice":
        sys.stdout.write("ANSWER first\nANSWER second\n")
    elif word == "quiet":
        sys.stdout.close(); os.close(1); time.sleep(60)
    elif word == "hang":
        if os.fork() == 0:
            time.sleep(60)
        time.sleep(60)
    elif word == "noise":
        sys.stderr.write("x" * 1000000); sys.stderr.flush()
        sys.stdout.write("not an answer\nANSWER " + "y" * 200000 + "\n")
    else:
        sys.stdout.write("ANSWER " + word + "\n")
    sys.stdout.flush()
"""


def server() -> LiveCommand:
    return RUNNER.spawn([sys.executable, "-I", "-c", SERVER])


def test_exchanges_in_order_over_one_process() -> None:
    live = server()
    assert live.exchange(b"one\n", MARK, 10) == b"ANSWER one"
    assert live.exchange(b"two\n", MARK, 10) == b"ANSWER two"
    pid = live.pid
    live.close()
    assert live.returncode == 0 and not live.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_line_left_from_an_earlier_exchange_never_answers_a_later_one() -> None:
    live = server()
    assert live.exchange(b"twice\n", MARK, 10) == b"ANSWER first"
    time.sleep(0.2)  # "second" has arrived, unread or buffered
    assert live.exchange(b"three\n", MARK, 10) == b"ANSWER three"
    live.close()


def test_a_process_that_closes_stdout_and_stays_is_killed() -> None:
    live = server()
    started = time.monotonic()
    assert live.exchange(b"quiet\n", MARK, 30) is None
    assert time.monotonic() - started < 10
    assert live.returncode == -9


def test_no_answer_within_the_bound_kills_the_whole_group() -> None:
    live = server()
    with pytest.raises(CommandTimeout, match="no answer within 1s"):
        live.exchange(b"hang\n", MARK, 1)
    assert live.returncode == -9
    time.sleep(0.2)
    group = live.pid
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(pid)
    assert members == []  # the forked child too


def test_large_stderr_and_answers_and_other_lines_do_not_block() -> None:
    live = server()
    line = live.exchange(b"noise\n", MARK, 20)
    assert line == b"ANSWER " + b"y" * 200000
    assert len(live.stderr) <= 4096  # its end, bounded (from a line start: none in 1 MB of x)
    # a megabyte written while it writes a megabyte back on stderr: neither side blocks
    big = b"z" * (1 << 20) + b"\n"
    assert live.exchange(big, MARK, 20) == b"ANSWER " + b"z" * (1 << 20)
    live.close()


def test_a_process_that_ended_gives_none_and_its_last_words() -> None:
    live = RUNNER.spawn(
        [sys.executable, "-I", "-c", "import sys; sys.stderr.write('gone: bye'); sys.exit(5)"]
    )
    assert live.exchange(b"x\n", MARK, 10) is None
    assert live.returncode == 5 and live.stderr == "gone: bye"


def test_a_command_that_cannot_start_is_one_line() -> None:
    with pytest.raises(CommandError, match="could not start"):
        RUNNER.spawn(["/nonexistent/ssh", "-T"])


def test_what_a_command_says_before_its_first_exchange_is_its_message() -> None:
    """A command that fails at once (ssh: cannot resolve the host) says why before the first
    exchange begins: that is this exchange's message, not something to drop."""
    live = RUNNER.spawn(
        [
            sys.executable,
            "-I",
            "-c",
            "import sys; sys.stderr.write('cannot resolve\\n'); sys.exit(255)",
        ]
    )
    time.sleep(0.5)  # it has written and ended before the caller gets to its exchange
    assert live.exchange(b"one\n", MARK, 10) is None
    assert live.returncode == 255
    assert "cannot resolve" in live.stderr


def test_stderr_kept_starts_at_a_line() -> None:
    """Only stderr's end is kept, from the start of a line: a line cut at the front could hold
    the tail of a secret, which masking would not recognize."""
    from flexhub.node import live as live_module

    lines = b"".join(b"line %d Secret-%04d\n" % (i, i) for i in range(2000))
    kept = live_module._kept_end(lines)
    assert len(kept) <= live_module._STDERR_KEPT and kept.startswith(b"line ")
    assert lines.endswith(kept)
    assert live_module._kept_end(b"short\n") == b"short\n"

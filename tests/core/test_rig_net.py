"""The VM rig's one network path (tests/rig/net.py, tests/rig/relay.py), host side: the relay
qemu runs per guest connection, with a real socketpair as its stdin and stdout (as libslirp
gives it) and a real TCP server, and the qemu arguments it is started with. The guest side is
tests/vm/test_nfs_provisioner_crash.py's."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from tests.rig import net


def test_the_relay_copies_both_ways_and_passes_a_half_close_on() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):  # until the guest's half-close reaches us
                data += chunk
            got.append(data)
            conn.sendall(b"answer:" + data[:10])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ours, theirs = socket.socketpair()
    with server, ours:
        relay = subprocess.Popen(
            [sys.executable, net.RELAY, "127.0.0.1", str(port)],
            stdin=theirs,
            stdout=theirs,
            stderr=theirs,
        )
        theirs.close()
        ours.sendall(b"x" * 300_000)
        ours.shutdown(socket.SHUT_WR)
        ours.settimeout(30)
        answer = b""
        while chunk := ours.recv(65536):
            answer += chunk
        assert relay.wait(30) == 0
    thread.join(5)
    assert got == [b"x" * 300_000]
    assert answer == b"answer:" + b"x" * 10  # nothing of the relay's own on the stream


def test_the_guest_reaches_one_address_and_nothing_else() -> None:
    args = net.qemu_args(6443, python="/usr/bin/python3")
    netdev = args[args.index("-netdev") + 1]
    assert "restrict=on" in netdev.split(",")
    assert netdev.count("guestfwd=") == 1 and "hostfwd" not in netdev
    assert netdev.endswith(
        f"guestfwd=tcp:{net.GUEST_ADDRESS}:{net.GUEST_PORT}-cmd:/usr/bin/python3 {net.RELAY} "
        "127.0.0.1 6443"
    )
    with pytest.raises(ValueError, match="guestfwd"):
        net.qemu_args(6443, python="/opt/py,thon/bin/python3")  # a comma ends qemu's option

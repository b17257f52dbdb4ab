"""The rig's wait for the guest agent (tests/rig/vm.py) on a machine so loaded that the boot
takes minutes: qemu reads nothing from the agent socket until the guest opens its port, so the
socket's buffer fills with pings. Host-only: a socketpair stands in for qemu's socket (its
buffer really fills), no VM is booted."""

from __future__ import annotations

import json
import socket
import threading
import time

from tests.rig.vm import VM


class Alive:
    def poll(self) -> None:
        return None


def test_a_full_agent_socket_does_not_fail_the_boot() -> None:
    host, guest = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    host.setblocking(False)
    try:  # the guest is still booting: the buffer is full before the first ping
        while True:
            host.send(b" " * 4096)
    except BlockingIOError:
        pass
    host.settimeout(1.0)  # as the wait for the last ping's answer left it

    def agent() -> None:  # the agent starts late, reads everything and answers each ping
        time.sleep(3)
        buf = b""
        guest.settimeout(10)
        while True:
            buf += guest.recv(1 << 16)
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    req = json.loads(line)
                except ValueError:
                    continue
                guest.sendall(json.dumps({"id": req["id"], "rc": 0}).encode() + b"\n")
                return

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    vm = VM()
    vm._sock = host
    vm.proc = Alive()  # type: ignore[assignment]
    try:
        vm._wait_agent(time.monotonic() + 30)  # before the fix: TimeoutError from sendall
    finally:
        vm.proc = None
        vm._sock = None
        host.close()
        guest.close()
    thread.join(5)

"""One guest connection to one host TCP port: what qemu's user-mode network runs (``guestfwd``
with ``cmd:``) for each connection the guest opens to the forwarded address, with that
connection as its stdin and stdout. Stdlib only, no shell: qemu splits the command line into
argv itself.

    python3 relay.py HOST PORT
"""

from __future__ import annotations

import os
import selectors
import socket
import sys


def relay(guest: socket.socket, host: socket.socket) -> None:
    """Copy both ways until either side closes; a half-close is passed on."""
    peers = {guest: host, host: guest}
    selector = selectors.DefaultSelector()
    for sock in peers:
        selector.register(sock, selectors.EVENT_READ)
    open_ends = 2
    while open_ends:
        for key, _ in selector.select():
            src: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                selector.unregister(src)
                open_ends -= 1
                try:
                    peers[src].shutdown(socket.SHUT_WR)
                except OSError:
                    return
                continue
            try:
                peers[src].sendall(data)
            except OSError:
                return


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    guest = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nothing of ours (a traceback) may reach the guest's stream
        os.dup2(devnull, fd)
    with guest, socket.create_connection((host, port), timeout=10) as upstream:
        upstream.settimeout(None)
        relay(guest, upstream)


if __name__ == "__main__":
    main()

"""The VM rig's one network path, off unless a test asks for it (``VM(forward_port=...)``): the
guest reaches one TCP port of the host at :data:`GUEST_ADDRESS`:``GUEST_PORT`` and nothing
else.

qemu's user-mode network with ``restrict=on`` (no route out of the guest: no NAT, no DNS, no
DHCP, no host services) and a single ``guestfwd`` whose ``cmd:`` runs :mod:`tests.rig.relay`
(no shell: qemu splits the command line into argv) for each connection the guest opens, so
that many connections at once work (a ``guestfwd`` to a chardev serves one connection, made
when qemu starts). The guest gets a virtio-net device with a fixed MAC, ``virtio_net``
loaded and a static address (:func:`configure_guest`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.rig.vm import VM

NETWORK = "10.0.2.0/24"
GUEST_CIDR = "10.0.2.15/24"
#: Where the guest reaches the forwarded host port.
GUEST_ADDRESS = "10.0.2.100"
GUEST_PORT = 443
MAC = "52:54:00:f1:e7:01"
RELAY = __file__.rsplit("/", 1)[0] + "/relay.py"


def qemu_args(host_port: int, python: str = sys.executable) -> list[str]:
    """qemu's arguments for the guest's one forward to 127.0.0.1:``host_port``."""
    for word in (python, RELAY):
        if any(c.isspace() or c in "'\"\\," for c in word):
            raise ValueError(f"cannot pass {word!r} in qemu's guestfwd command line")
    command = f"{python} {RELAY} 127.0.0.1 {int(host_port)}"
    netdev = (
        f"user,id=rignet,restrict=on,net={NETWORK},"
        f"guestfwd=tcp:{GUEST_ADDRESS}:{GUEST_PORT}-cmd:{command}"
    )
    return ["-netdev", netdev, "-device", f"virtio-net-pci,netdev=rignet,mac={MAC}"]


_CONFIGURE = """
modprobe virtio_net
name=
for i in $(seq 100); do
    for dev in /sys/class/net/*; do
        [ "$(cat "$dev/address")" = "$1" ] && name=${dev##*/}
    done
    [ -n "$name" ] && break
    sleep 0.1
done
[ -n "$name" ] || { echo "no interface with MAC $1"; exit 1; }
ip link set "$name" up
ip addr add "$2" dev "$name"
"""


def configure_guest(vm: VM) -> None:
    """Bring the guest's interface up with its static address (found by its MAC: udevd may
    rename it)."""
    vm.run(["/bin/sh", "-c", _CONFIGURE, "net", MAC, GUEST_CIDR])

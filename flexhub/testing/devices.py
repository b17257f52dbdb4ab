"""What the kit's runs leave attached to the node: loop devices of the run's files, block
devices (the default of :meth:`flexhub.testing.Conformance.attached`)."""

from __future__ import annotations

from flexhub.admin.harness import KUBELET_ENV
from flexhub.testing.env import KitEnv

__all__ = ["block_devices", "default_attached", "detach_loops"]


def loops(env: KitEnv) -> list[tuple[str, str]]:
    """Loop devices backed by a file under the run's directory: (device, file)."""
    listed = env.host.run(
        ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
        env=KUBELET_ENV,
        timeout=60,
    )
    found = []
    for line in listed.output.decode(errors="replace").splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[1].strip().startswith(env.base + "/"):
            found.append((parts[0], parts[1].strip()))
    return found


def detach_loops(env: KitEnv) -> None:
    """Detach the loop devices of the run's own files (after a failed check)."""
    for device, _ in loops(env):
        env.host.run(["losetup", "--detach", device], env=KUBELET_ENV, timeout=60)


def default_attached(env: KitEnv) -> list[str]:
    """Loop devices backed by a file under the run's directory and, on a host where only the
    kit makes block devices (``Host.isolated``: a dedicated VM), block devices that appeared
    since the run started (``KitEnv.devices_at_start``). On a shared machine other processes
    make devices too: extend :meth:`Conformance.attached` with what the backend attaches."""
    found = [f"{device} ({path})" for device, path in loops(env)]
    if getattr(env.host, "isolated", False):
        found += [f"/dev/{name}" for name in sorted(block_devices(env) - env.devices_at_start)]
    return found


def block_devices(env: KitEnv) -> set[str]:
    """Whole block devices other than loop devices, by name."""
    out = env.host.run(
        ["lsblk", "--nodeps", "--noheadings", "--output", "NAME,TYPE"],
        env=KUBELET_ENV,
        timeout=60,
    )
    names = set()
    for line in out.output.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] != "loop":
            names.add(parts[0])
    return names

"""Host side of the flexhub VM rig: boot a stock Debian kernel under qemu and
run commands in it.

The guest needs no disk image.  A ~1.5 MB busybox initramfs (``image.py`` builds it once into
``/var/tmp/flexhub-rig/<kver>/<hash>/``) loads virtio-pci, 9p and overlay,
mounts the host's ``/`` read-only over virtio-9p under a tmpfs overlay and
switch_roots into it; ``stage2.sh`` then starts ``agent.py`` as PID 1, which
serves JSON requests on a virtio-serial port.  The guest therefore sees the
host's python, nfs-utils, open-iscsi, rtslib and this checkout at the same
paths, and nothing it writes reaches the host.

qemu always dies with us: ``close()`` kills it, an ``atexit`` hook closes every
VM still open, and qemu gets ``PR_SET_PDEATHSIG`` so even a SIGKILLed pytest
takes it down.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.rig import net
from tests.rig.image import (
    BUSYBOX_CANDIDATES,
    RIG_DIR,
    build_initramfs,
    find_kernel,
    kernel_image,
)

GUEST_PYTHON = sys.executable
SYSTEM_PYTHON = "/usr/bin/python3"
QEMU = "qemu-system-x86_64"
_INSTALL = """import sys
from pathlib import Path
from flexhub.admin.install import install_on_node
print(install_on_node(sys.argv[1], config=Path(sys.argv[2]) if sys.argv[2] else None)[0])
"""
#: The guest's wrapper for the runtime's interpreter (in the guest's own tmpfs overlay).
RUNTIME_PYTHON = "/usr/local/sbin/flexhub-runtime-python"
KUBELET_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


#: Guest commands run by this process, by kind (:func:`command_kind`): (count, seconds in the
#: guest). The rig's pytest plugin prints them at the end of a session.
COMMAND_STATS: dict[str, tuple[int, float]] = {}


def command_kind(argv: list[str], flexhub_python: str) -> str:
    """What a guest command is, for :data:`COMMAND_STATS`: a driver call (an executable in a
    plugin directory's ``vendor~driver/``), a ``python -m flexhub`` command (fence, doctor,
    install), another Python script, or anything else."""
    first = argv[0] if argv else ""
    if "~" in os.path.basename(os.path.dirname(first)):
        return "driver call"
    if first in (flexhub_python, GUEST_PYTHON):
        return "flexhub command" if argv[1:3] == ["-m", "flexhub"] else "python script"
    return "other"


class RigError(RuntimeError):
    """The rig itself failed (boot, agent, transport)."""


class CommandError(RigError):
    """A command run with ``check=True`` exited non-zero."""

    def __init__(self, result: Result) -> None:
        self.result = result
        super().__init__(
            f"guest command {result.argv!r} exited {result.rc}"
            f"{' (timed out)' if result.timed_out else ''}:\n{result.output}"
        )


@dataclass
class Result:
    """Outcome of one guest command."""

    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    timed_out: bool = False
    duration: float = 0.0
    pid: int | None = None

    @property
    def output(self) -> str:
        """stdout followed by stderr (exactly interleaved when run with merge=True)."""
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.rc == 0


def unavailable_reason() -> str | None:
    """Why this machine cannot run the rig at all, or None if it can."""
    if os.geteuid() != 0:
        return "VM rig needs root (9p export of / and guest mounts)"
    if shutil.which(QEMU) is None:
        return f"VM rig needs {QEMU} (run .ci/install-rig.sh)"
    if not any(os.path.exists(p) for p in BUSYBOX_CANDIDATES):
        return "VM rig needs busybox-static (run .ci/install-rig.sh)"
    if find_kernel() is None:
        return "VM rig needs a Debian kernel in /boot with modules (linux-image-amd64)"
    return None


# --------------------------------------------------------------------------
# the VM

_LIVE: weakref.WeakSet[VM] = weakref.WeakSet()


def _close_all() -> None:
    for vm in list(_LIVE):
        vm.close()


atexit.register(_close_all)


WORKDIR_PREFIX = "flexhub-rig-"
#: Seconds between the pings that wait for the guest agent at boot.
PING_INTERVAL = 2.0


def _remove_stale_workdirs() -> None:
    """Remove work directories left by a SIGKILLed session (owner pid gone)."""
    for owner in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*/owner"):
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(owner.parent, ignore_errors=True)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # Ignore SIGINT so that ^C in pytest reaches pytest, which closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class VM:
    """One qemu guest with the rig agent.  Use as a context manager or call
    ``start()`` and, always, ``close()``."""

    memory_mb: int = 1024
    smp: int = 1
    kernel: str | None = None
    #: qemu's ``-cpu`` model (``FLEXHUB_RIG_CPU``; default ``max``).
    cpu: str = field(default_factory=lambda: os.environ.get("FLEXHUB_RIG_CPU", "max"))
    boot_timeout: float = 180.0
    python: str = GUEST_PYTHON
    #: A relocatable runtime (``deploy/build_runtime.py``, :mod:`tests.runtime_cache`) the
    #: guest runs flexhub through, as a node does; ``None``: the test interpreter's install.
    runtime: str | None = None
    agent_python: str = field(
        default_factory=lambda: SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else GUEST_PYTHON
    )
    #: Opt-in: a host TCP port on 127.0.0.1 the guest reaches, and nothing else, at
    #: ``net.GUEST_ADDRESS:net.GUEST_PORT`` (:mod:`tests.rig.net`); ``None``: no network device.
    forward_port: int | None = None
    boot_seconds: float = 0.0
    workdir: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _sock: socket.socket | None = field(default=None, repr=False)
    _buf: bytes = field(default=b"", repr=False)
    _next_id: int = field(default=1, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __hash__(self) -> int:
        return id(self)

    # ---- lifecycle ----------------------------------------------------

    def start(self) -> VM:
        """Boot the guest and wait until the agent answers."""
        reason = unavailable_reason()
        if reason:
            raise RigError(reason)
        kver = self.kernel or find_kernel()
        assert kver is not None
        self.kernel = kver
        t0 = time.monotonic()
        initrd = build_initramfs(kver)
        image = kernel_image(kver)
        _remove_stale_workdirs()
        self.workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
        (self.workdir / "owner").write_text(f"{os.getpid()}\n")
        sock_path = self.workdir / "agent.sock"
        append = " ".join(
            [
                "console=ttyS0",
                "quiet",
                "loglevel=4",
                "panic=-1",
                "rdinit=/init",
                f"rig.stage2={RIG_DIR / 'stage2.sh'}",
                f"rig.python={self.agent_python}",
                f"rig.agent={RIG_DIR / 'agent.py'}",
            ]
        )
        argv = [
            QEMU,
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            self.cpu,
            "-smp",
            str(self.smp),
            "-m",
            str(self.memory_mb),
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
            "-monitor",
            "none",
            "-kernel",
            str(image),
            "-initrd",
            str(initrd),
            "-append",
            append,
            "-serial",
            f"file:{self.workdir / 'console.log'}",
            "-fsdev",
            "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device",
            "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-device",
            "virtio-serial-pci",
            "-chardev",
            f"socket,id=rig,path={sock_path},server=on,wait=off",
            "-device",
            "virtserialport,chardev=rig,name=rig",
        ]
        if self.forward_port is not None:
            argv += net.qemu_args(self.forward_port)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=open(self.workdir / "qemu.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        _LIVE.add(self)
        try:
            self._connect(sock_path, t0 + self.boot_timeout)
            self._wait_agent(t0 + self.boot_timeout)
            if self.runtime:
                self._install_runtime_python()
            if self.forward_port is not None:
                net.configure_guest(self)
        except BaseException:
            self.close()
            raise
        self.boot_seconds = time.monotonic() - t0
        return self

    def _connect(self, path: Path, deadline: float) -> None:
        while True:
            self._check_alive()
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(path))
                self._sock = s
                return
            except OSError:
                s.close()
                if time.monotonic() > deadline:
                    raise RigError("qemu never opened the agent socket" + self._logs()) from None
                time.sleep(0.02)

    def _wait_agent(self, deadline: float) -> None:
        # A ping every few seconds, not every second: until the agent reads the port, qemu
        # reads nothing from the socket, and on a loaded machine (a boot of minutes) pings
        # sent each second filled the socket's buffer, so that sendall timed out and failed
        # the boot. A ping that still cannot be sent is retried with the next.
        while True:
            try:
                req_id = self._send({"op": "ping"})
            except TimeoutError:
                req_id = 0  # answers carry ids >= 1: wait out the interval, then ping again
            try:
                self._recv(req_id, min(deadline, time.monotonic() + PING_INTERVAL))
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RigError(
                        f"guest agent did not answer within {self.boot_timeout:.0f}s" + self._logs()
                    ) from None

    def _check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RigError("qemu is not running" + self._logs())

    def _logs(self) -> str:
        parts = []
        if self.workdir:
            for name in ("qemu.log", "console.log"):
                try:
                    text = (self.workdir / name).read_text(errors="replace")
                except OSError:
                    continue
                parts.append(f"\n--- {name} (tail) ---\n" + "\n".join(text.splitlines()[-40:]))
        return "".join(parts)

    def console_log(self) -> str:
        """The guest's serial console so far."""
        if not self.workdir:
            return ""
        try:
            return (self.workdir / "console.log").read_text(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def close(self) -> None:
        """Kill qemu (always safe to call, idempotent) and remove the workdir."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _LIVE.discard(self)
        if self.workdir is not None and not os.environ.get("FLEXHUB_RIG_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> VM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport ----------------------------------------------------

    def _send(self, req: dict[str, Any]) -> int:
        if self._sock is None:
            raise RigError("VM is not running")
        req_id = self._next_id
        self._next_id += 1
        req["id"] = req_id
        self._sock.sendall(json.dumps(req).encode() + b"\n")
        return req_id

    def _recv(self, req_id: int, deadline: float) -> dict[str, Any]:
        assert self._sock is not None
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    resp: dict[str, Any] = json.loads(line)
                except ValueError:
                    continue
                if resp.get("id") == req_id:
                    return resp
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._sock.settimeout(min(remaining, 1.0))
            try:
                chunk = self._sock.recv(1 << 20)
            except TimeoutError:
                self._check_alive()
                continue
            if not chunk:
                raise RigError("agent connection closed" + self._logs())
            self._buf += chunk

    def request(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one raw request; wait ``timeout`` (+ margin) for its answer."""
        with self._lock:
            self._check_alive()
            req_id = self._send(req)
            try:
                return self._recv(req_id, time.monotonic() + timeout + 15)
            except TimeoutError:
                self.close()
                raise RigError(f"agent gave no answer to {req!r}; VM killed") from None

    # ---- API ----------------------------------------------------------

    def run(
        self,
        argv: list[str],
        timeout: float = 60,
        check: bool = True,
        input: str | None = None,
        env: dict[str, str] | None = None,
        env_add: dict[str, str] | None = None,
        cwd: str | None = None,
        merge: bool = False,
    ) -> Result:
        """Run argv (no shell) in the guest.  ``env`` replaces the default
        environment, ``env_add`` extends it; ``merge`` sends stderr into stdout."""
        resp = self.request(
            {
                "op": "run",
                "argv": list(argv),
                "timeout": timeout,
                "input": input,
                "env": env,
                "env_add": env_add,
                "cwd": cwd,
                "merge": merge,
            },
            timeout,
        )
        result = Result(
            argv=list(argv),
            rc=int(resp["rc"]),
            stdout=str(resp.get("stdout", "")),
            stderr=str(resp.get("stderr", "")),
            timed_out=bool(resp.get("timed_out")),
            duration=float(resp.get("duration", 0.0)),
        )
        kind = command_kind(argv, self.flexhub_python)
        kinds = [kind]
        if kind == "other":  # which of them: the next lever on the VM tier's time
            kinds.append(f"  {os.path.basename(argv[0]) if argv else ''}")
        for kind in kinds:
            count, seconds = COMMAND_STATS.get(kind, (0, 0.0))
            COMMAND_STATS[kind] = (count + 1, seconds + result.duration)
        if check and result.rc != 0:
            raise CommandError(result)
        return result

    def sh(self, script: str, timeout: float = 60, check: bool = True) -> Result:
        """Convenience: run a /bin/sh -c script in the guest (tests only)."""
        return self.run(["/bin/sh", "-c", script], timeout=timeout, check=check)

    def spawn(self, argv: list[str], log: str | None = None) -> int:
        """Start argv in the background in the guest; returns its pid."""
        resp = self.request({"op": "run", "argv": list(argv), "background": True, "log": log}, 30)
        if resp.get("rc") != 0:
            raise RigError(f"cannot spawn {argv!r}: {resp.get('stderr')}")
        return int(resp["pid"])

    def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Write a file in the guest (parents are created)."""
        raw = data.encode() if isinstance(data, str) else data
        resp = self.request(
            {
                "op": "write_file",
                "path": path,
                "mode": mode,
                "data": base64.b64encode(raw).decode(),
            },
            30,
        )
        if resp.get("rc") != 0:
            raise RigError(f"cannot write {path}: {resp.get('stderr')}")

    def read_file(self, path: str) -> bytes:
        """Read a file from the guest."""
        resp = self.request({"op": "read_file", "path": path}, 30)
        if resp.get("rc") != 0:
            raise RigError(f"cannot read {path}: {resp.get('stderr')}")
        return base64.b64decode(str(resp["data"]))

    @property
    def flexhub_python(self) -> str:
        """The interpreter that runs flexhub in the guest: the runtime's (through
        :data:`RUNTIME_PYTHON`, a wrapper that starts it with its own loader) when the VM has
        one, else the test interpreter. ``flexhub_python -m flexhub install`` writes a shim that
        runs the same interpreter."""
        return RUNTIME_PYTHON if self.runtime else self.python

    def _install_runtime_python(self) -> None:
        assert self.runtime is not None
        marker = json.loads((Path(self.runtime) / "flexhub-runtime.json").read_text("utf-8"))
        words = [
            f"{self.runtime}/{marker['loader']}",
            "--library-path",
            f"{self.runtime}/{marker['library_path']}",
            f"{self.runtime}/{marker['python']}",
        ]
        script = "#!/bin/sh\nexec " + " ".join(shlex.quote(w) for w in words) + ' "$@"\n'
        self.write_file(RUNTIME_PYTHON, script, mode=0o755)

    def install_flexhub(self, plugin_dir: str, config: str | None = None) -> str:
        """Install the driver in the guest the way a node does (through the runtime, if the VM
        has one); returns its path."""
        # ``flexhub install`` without its command line: the same checks, install and record
        # (flexhub.admin.install.install_on_node), but not typer, whose import (with pydantic)
        # costs about 10 s of the emulated guest.
        argv = [self.flexhub_python, "-I", "-c", _INSTALL, plugin_dir, config or ""]
        self.run(argv, cwd=str(RIG_DIR.parent.parent), timeout=120)
        driver = f"{plugin_dir.rstrip('/')}/k8s~flexhub/flexhub"
        self.run(["test", "-x", driver])
        return driver

    def call_driver(self, driver: str, argv: list[str], timeout: float = 300) -> tuple[int, str]:
        """Call the driver as kubelet does: argv, stdin /dev/null, stderr into
        stdout, ``env -i PATH=...``, cwd /.  Returns (rc, output)."""
        result = self.run(
            [driver, *argv],
            timeout=timeout,
            check=False,
            env=dict(KUBELET_ENV),
            cwd="/",
            merge=True,
        )
        return result.rc, result.output


def main() -> None:
    """``python -m tests.rig.vm [cmd ...]``: boot, run a command, report timing."""
    argv = sys.argv[1:] or ["uname", "-a"]
    with VM() as vm:
        print(f"booted {vm.kernel} in {vm.boot_seconds:.2f}s", file=sys.stderr)
        t = time.monotonic()
        res = vm.run(argv, check=False)
        print(res.output, end="")
        print(f"rc={res.rc} in {time.monotonic() - t:.3f}s", file=sys.stderr)


if __name__ == "__main__":
    main()

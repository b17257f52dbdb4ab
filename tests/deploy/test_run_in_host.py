"""``run_in_host`` runs a driver as kubelet does (bare environment, cwd /, inside the host's
root) and returns exactly what it wrote: no fork handler of a library the calling process
holds may write into that output.

The failure it guards against (CI 2026-12-05): it chrooted in a ``preexec_fn``, so each run
forked Python code; in a process where gRPC was live (a CSI test earlier in the session), about
one child in sixteen wrote gRPC's ``Epoll1Poller ... epoll_wait error: Bad file descriptor``
before the driver's reply, and kubelet's parse of that reply failed. The host root / now forks
no Python code; another root still chroots in a ``preexec_fn``, and there (CI 2026-12-06,
a host root symlinked to /) about one child in four died of SIGABRT or SIGSEGV before exec
while a gRPC server was live, until ``flexhub.csi`` turned gRPC's fork support off. The check
runs in a fresh interpreter that imports gRPC as the CSI plugin does (through ``flexhub.csi``),
with gRPC's logging left on (the test process turns it off)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexhub.admin.deploy import run_in_host
from tests.conftest import needs_root

_CHECK = r"""
import concurrent.futures, json, sys
from pathlib import Path
import flexhub.csi  # as the plugin: every flexhub module that uses gRPC is in this package
import grpc
from flexhub.admin.deploy import run_in_host

server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
grpc.channel_ready_future(channel).result(timeout=30)
found = {}
for root in sys.argv[1:]:
    found[root] = [run_in_host(Path(root), ["/bin/echo", "reply"]) for _ in range(60)]
print(json.dumps({root: [[code, out.decode()] for code, out in runs] for root, runs in found.items()}))
"""


@needs_root
def test_the_output_is_the_driver_s_alone_while_grpc_is_live(trusted_dir: Path) -> None:
    """The host root ``/`` (the CSI plugin's and the tests' case): no Python code runs between
    fork and exec. Another root (here one symlinked to /) is entered by a ``preexec_fn``
    chroot: with gRPC's fork support off, its handlers do not run in the child."""
    other = trusted_dir / "host"
    other.symlink_to("/")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, "/", str(other)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    for root, runs in found.items():
        assert len(runs) == 60, root
        bad = [out for code, out in runs if [code, out] != [0, "reply\n"]]
        assert bad == [], (root, bad[:3])


@needs_root
def test_a_driver_missing_in_the_host_root_is_an_oserror(trusted_dir: Path) -> None:
    host = trusted_dir / "host"
    host.mkdir()
    with pytest.raises(OSError) as caught:
        run_in_host(host, ["/flexhub-no-such-driver", "init"])
    assert caught.value.errno == errno.ENOENT
    assert caught.value.filename == "/flexhub-no-such-driver"


@needs_root
def test_in_the_host_root_the_driver_runs_bare_in_its_root(trusted_dir: Path) -> None:
    host = trusted_dir / "host"
    host.symlink_to("/")
    code, out = run_in_host(
        host,
        [
            sys.executable,
            "-I",
            "-c",
            "import json, os; print(json.dumps([os.getcwd(), dict(os.environ)]))",
        ],
    )
    assert code == 0, out
    cwd, env = json.loads(out)
    from flexhub.admin.harness import KUBELET_ENV

    assert cwd == "/" and env == dict(KUBELET_ENV)

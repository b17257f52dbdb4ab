"""scripts/quickstart.sh, the quick start's one set-up command, on a machine without Go: it
installs what `flexhub demo` needs (apt-get for the missing tools, a venv, flexhub and its
backends) and ends in a successful demo, as root without sudo, in a root-only directory,
leaving nothing in the host's /var/lib/flexhub or /var/log/flexhub."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import flexhub
from tests.conftest import REPO, is_root

SCRIPT = REPO / "scripts" / "quickstart.sh"
#: what the test hides from PATH: Go (the demo must not need it) and xfsprogs' tools (missing,
#: so that the script must ask apt-get for them)
HIDDEN = {"go", "gofmt", "mkfs.xfs", "xfs_growfs"}

pytestmark = pytest.mark.skipif(not is_root(), reason="flexhub demo needs root")


def _farm(bin_dir: Path, hidden: set[str]) -> None:
    """``bin_dir``: a link to every command on this PATH but ``hidden``, first found first."""
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            target = bin_dir / entry.name
            if entry.name in hidden or target.exists() or target.is_symlink():
                continue
            if entry.is_file() and os.access(entry.path, os.X_OK):
                target.symlink_to(os.path.realpath(entry.path))


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _environ(trusted: Path, bin_dir: Path) -> dict[str, str]:
    for directory in ("home", "tmp"):
        (trusted / directory).mkdir(exist_ok=True)
    return {
        "PATH": str(bin_dir),
        "HOME": str(trusted / "home"),
        "TMPDIR": str(trusted / "tmp"),  # pip's builds too, off /tmp
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "PYTHON": str(Path(sys.base_prefix) / "bin" / "python3"),
        "FLEXHUB_VENV": str(trusted / "venv"),
        "FLEXHUB_DEMO_DIR": str(trusted / "demo"),
        # the test machine's packages are installed already: nothing to download
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip reads this one inverted: no isolation
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def _venv(trusted: Path) -> None:
    """A venv over this machine's packages where the script looks (it keeps a venv it finds
    and installs this checkout into it), so that pip needs no index: without a pip of its
    own, it runs this machine's pip and setuptools."""
    venv = [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip"]
    subprocess.run([*venv, str(trusted / "venv")], check=True)


def _quickstart(
    trusted: Path, bin_dir: Path, timeout: int, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``bash scripts/quickstart.sh`` with only ``bin_dir`` on its PATH."""
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env=_environ(trusted, bin_dir),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_quick_start_installs_what_is_missing_and_ends_in_a_demo(trusted_dir: Path) -> None:
    host_dirs = [Path("/var/lib/flexhub"), Path("/var/log/flexhub")]
    before = [d.exists() for d in host_dirs]
    bin_dir = trusted_dir / "bin"
    _farm(bin_dir, HIDDEN | {"apt-get", "sudo"})
    assert shutil.which("go", path=str(bin_dir)) is None
    assert shutil.which("mkfs.xfs", path=str(bin_dir)) is None
    record = trusted_dir / "apt-get.log"
    xfs = [shutil.which(tool) for tool in ("mkfs.xfs", "xfs_growfs")]
    assert all(xfs), "xfsprogs is not installed on this machine"
    # apt-get: records what it was asked; "installing" xfsprogs links its tools back
    links = "".join(f'  ln -s {tool} "{bin_dir}/"\n' for tool in xfs)
    _stub(
        bin_dir / "apt-get",
        f'echo "$*" >> "{record}"\ncase " $* " in *" install "*xfsprogs*)\n{links};; esac\n',
    )
    _stub(bin_dir / "sudo", f'echo "sudo $*" >> "{record}"; exit 97\n')  # root needs none
    _venv(trusted_dir)
    proc = _quickstart(trusted_dir, bin_dir, 300, cwd=trusted_dir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    asked = record.read_text().splitlines()
    assert asked[0] == "update -qq", asked
    assert asked[1].startswith("install -y") and asked[1].split()[-1] == "xfsprogs", asked
    assert len(asked) == 2, asked  # nothing else missing, and no sudo as root
    assert "summary: ok: 8 of 8 kubelet calls ok" in proc.stdout, out
    assert "quickstart: done" in proc.stdout, out
    venv_flexhub = trusted_dir / "venv" / "bin" / "flexhub"
    version = subprocess.run(
        [str(venv_flexhub), "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip().endswith(flexhub.__version__)
    code = subprocess.run(
        [
            str(trusted_dir / "venv" / "bin" / "python"),
            "-c",
            "import flexhub; print(flexhub.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert code.stdout.startswith(str(REPO)), code.stdout  # this checkout, editable
    assert not (trusted_dir / "demo").exists()  # the demo's tree is gone
    assert [d.exists() for d in host_dirs] == before


def test_without_root_or_sudo_it_says_what_to_run_in_one_line(trusted_dir: Path) -> None:
    bin_dir = trusted_dir / "bin"
    _farm(bin_dir, HIDDEN | {"sudo", "id"})
    _stub(bin_dir / "id", "echo 1000\n")  # a user's shell
    proc = _quickstart(trusted_dir, bin_dir, 60)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "quickstart: the demo needs root and there is no sudo: run it as root "
        "(su -c 'bash scripts/quickstart.sh')"
    ]
    assert not (trusted_dir / "venv").exists()  # nothing was made


def test_a_user_with_sudo_runs_only_the_root_steps_through_it(trusted_dir: Path) -> None:
    bin_dir = trusted_dir / "bin"
    _farm(bin_dir, {"go", "gofmt", "sudo", "id", "apt-get"})
    record = trusted_dir / "sudo.log"
    _stub(bin_dir / "id", "echo 1000\n")  # a user's shell (the test runs as root)
    _stub(bin_dir / "sudo", f'echo "$*" >> "{record}"\nexec "$@"\n')
    _stub(bin_dir / "apt-get", f'echo "apt-get $*" >> "{record}"; exit 97\n')  # none missing
    _venv(trusted_dir)
    proc = _quickstart(trusted_dir, bin_dir, 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary: ok: 8 of 8 kubelet calls ok" in proc.stdout
    demo = trusted_dir / "demo"
    assert record.read_text().splitlines() == [
        f"mkdir -p -m 0755 {demo}",
        f"env TMPDIR={demo} {trusted_dir / 'venv' / 'bin' / 'flexhub'} demo",
        f"rmdir {demo}",
    ]  # the venv and pip are the user's

"""The relocatable runtime the tests use, built from this checkout by
``deploy/build_runtime.py`` once per set of inputs and kept for the next session.

Two tiers need it: the deployment tests (an image, a DaemonSet install) and the VM rig, whose
guest runs the driver through it as a node does (a guest call then starts the runtime's own
interpreter, with no ``site`` ``.pth`` files and byte-compiled modules, instead of the editable
install). ``.ci/run`` builds it once before the sessions start; a session that finds no
runtime for its inputs builds one (about a minute) under that entry's lock, so two sessions
never build the same one twice, and a session waits only for the profile it asks for.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Where built runtimes are kept, one per digest of their inputs. It must be root's and
#: writable by no one else on the way, as must the runtime found there (a guest driver runs
#: from it: nothing may run from what another user can write; :func:`check_trusted`);
#: ``.ci/run`` sets it to ``$FLEXHUB_CI_CACHE/runtime``.
RUNTIME_CACHE_ENV = "FLEXHUB_RUNTIME_CACHE"
DEFAULT_CACHE = Path("/var/cache/flexhub-ci/runtime")
RUNTIME_INPUTS = ("flexhub", "backends", "deploy/build_runtime.py", "pyproject.toml")
SKIP_PARTS = {"__pycache__", "build", "dist", ".mypy_cache", ".ruff_cache"}
MARKER = "flexhub-runtime.json"
#: The interpreter a runtime is built from, if set (``deploy/build_runtime.py`` copies the one
#: that runs it); else :data:`SYSTEM_PYTHON` where it can build one, else this one.
RUNTIME_PYTHON_ENV = "FLEXHUB_RUNTIME_PYTHON"
#: The distribution's interpreter of this Python version. Debian's package is built with PGO
#: and LTO on amd64 (per its packaging) and has libpython linked in; pyenv's (the tests' own on
#: this kind of machine) without ``--enable-optimizations`` and with a shared libpython. Under
#: the VM rig's emulation that is paid by every guest driver call: Debian's starts in 0.34 s
#: against 0.65 s, imports an iSCSI mount's modules in 1.5 s against 2.3 s and runs a
#: pure-Python loop 1.7 times as fast (1.6 times on the host).
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
#: Run by a candidate interpreter: its version, then its distributions (pip's, setuptools'
#: and every other one the build may use); it fails where pip cannot run.
DESCRIBE = (
    "import sys, pip\n"
    "from importlib.metadata import distributions\n"
    "print(sys.version)\n"
    "print('\\n'.join(sorted(f\"{d.metadata['Name']}=={d.version}\" for d in distributions())))\n"
)
#: The third-party backend every test runtime is built with (``--with``): the one
#: ``flexhub new-backend`` writes, as a backend author would ship it.
THIRD_PARTY = "mystore"


def _describe(python: str) -> str | None:
    """``python``'s version and distributions (:data:`DESCRIBE`), or None if it cannot run
    pip (or at all, or within a minute). Asked as the build runs it (no ``-I``, in
    :data:`REPO`), so whatever changes which pip and setuptools the build gets (a user site,
    ``PYTHONPATH``) changes the description, and so the key."""
    try:
        proc = subprocess.run(
            [python, "-c", DESCRIBE], cwd=REPO,
            capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _of_this_version(described: str) -> bool:
    """Whether a description's interpreter is of this Python's major.minor (the runtime's
    paths, ``lib/python3.X``, and the tests assume it)."""
    first = described.split(None, 1)[0] if described.strip() else ""
    return first.split(".")[:2] == [str(v) for v in sys.version_info[:2]]


@functools.cache
def runtime_python() -> tuple[str, str]:
    """The interpreter runtimes are built from (:data:`RUNTIME_PYTHON_ENV`, else
    :data:`SYSTEM_PYTHON` if it is of this version and runs pip, else this one), as an
    absolute path, and its description (:func:`_describe`).

    :raises RuntimeError: if the one named by :data:`RUNTIME_PYTHON_ENV` is not found, cannot
        run pip or is of another version.
    """
    chosen = os.environ.get(RUNTIME_PYTHON_ENV)
    if chosen:
        found = shutil.which(chosen)
        described = _describe(os.path.abspath(found)) if found else None
        if found is None or described is None or not _of_this_version(described):
            raise RuntimeError(
                f"{RUNTIME_PYTHON_ENV}={chosen}: not a Python "
                f"{sys.version_info[0]}.{sys.version_info[1]} that runs pip"
            )
        return os.path.abspath(found), described
    if os.path.realpath(SYSTEM_PYTHON) != os.path.realpath(sys.executable):
        described = _describe(SYSTEM_PYTHON)
        if described is not None and _of_this_version(described):
            return SYSTEM_PYTHON, described
    return sys.executable, _describe(sys.executable) or sys.version


def runtime_inputs_digest() -> str:
    """What a runtime is built from: this checkout's sources, the interpreter
    (:func:`runtime_python`), its packages and the system libraries (dpkg's status) it
    bundles."""
    python, described = runtime_python()
    digest = hashlib.sha256(f"{python}\n{described}\n".encode())
    for path in (os.path.realpath(python), "/var/lib/dpkg/status"):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            digest.update(f"{path}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for top in RUNTIME_INPUTS:
        base = REPO / top
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for file in files:
            rel = file.relative_to(REPO)
            if (
                not file.is_file()
                or SKIP_PARTS & set(rel.parts)
                or rel.name.endswith((".pyc", ".egg-info"))
            ):
                continue
            if any(part.endswith(".egg-info") for part in rel.parts):
                continue
            digest.update(f"{rel}\n".encode() + file.read_bytes())
    return digest.hexdigest()[:16]


def third_party_backend(base: Path) -> Path:
    """``flexhub new-backend mystore`` in ``base``: a project directory pip installs."""
    proc = subprocess.run(
        [sys.executable, "-m", "flexhub", "new-backend", THIRD_PARTY, "--directory", str(base)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"flexhub new-backend failed:\n{proc.stdout}{proc.stderr}")
    (project,) = base.iterdir()
    return project


def build_runtime(out: Path, profile: str = "full") -> Path:
    """Build a runtime (with the scaffolded third-party backend) into ``out``; its directory.
    ``profile`` is build_runtime.py's (``node``: no API client, no CSI packages)."""
    extra = third_party_backend(Path(tempfile.mkdtemp(prefix="third-party-")))
    try:
        proc = subprocess.run(
            [runtime_python()[0], str(REPO / "deploy" / "build_runtime.py"), str(out),
             "--with", str(extra), "--profile", profile],
            capture_output=True, text=True, timeout=900, check=False, cwd=REPO,
        )  # fmt: skip
    finally:
        shutil.rmtree(extra.parent, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"deploy/build_runtime.py failed:\n{proc.stderr[-3000:]}")
    (out / "build.log").write_text(proc.stderr)  # its progress lines, beside the runtime
    path = Path(proc.stdout.strip().splitlines()[-1])
    if not (path / MARKER).is_file():
        raise RuntimeError(f"deploy/build_runtime.py made no runtime in {path}")
    return path


def check_trusted(runtime: Path) -> None:
    """Refuse a runtime another user could have planted or changed: every directory on its
    path root's and writable by no one else (:func:`flexhub.admin.trust.trusted_path`), and
    every file and directory in it root's and not writable by group or others.

    :raises RuntimeError: naming the first path that is not.
    """
    from flexhub.admin.trust import trusted_path
    from flexhub.errors import FlexhubError

    try:
        trusted_path(str(runtime))
    except FlexhubError as exc:
        raise RuntimeError(f"refusing the test runtime: {exc}") from None
    for top, dirs, files in os.walk(runtime):
        for name in (*dirs, *files):
            path = os.path.join(top, name)
            st = os.lstat(path)
            if st.st_uid != 0 or (st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode)):
                raise RuntimeError(
                    f"refusing the test runtime: {path} is not root's alone "
                    f"(owner {st.st_uid}, mode {st.st_mode & 0o7777:o})"
                )


def _found(keyed: Path) -> Path | None:
    found = sorted(keyed.glob(f"flexhub-*/{MARKER}"))
    return found[0].parent if found else None


def cached_runtime(cache: Path | None = None, profile: str = "full") -> Path:
    """The runtime of this checkout's inputs from ``cache`` (default ``$FLEXHUB_RUNTIME_CACHE``,
    else :data:`DEFAULT_CACHE`), built there first if it is missing; ``profile`` as
    build_runtime.py's (each profile its own entry)."""
    root = cache or Path(os.environ.get(RUNTIME_CACHE_ENV) or DEFAULT_CACHE)
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    keyed = root / (runtime_inputs_digest() + ("" if profile == "full" else f"-{profile}"))
    # One lock per entry: one build per inputs, however many sessions ask, and a session that
    # wants the full runtime (the VM guests) never waits out the node profile's build. The
    # lock file is root's alone (0600, never through a symlink), so no other user can hold it.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(root / f".lock-{keyed.name}", flags, 0o600), "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        os.utime(lock.fileno())  # in use: .ci/run's weekly prune spares it
        found = _found(keyed)
        if found is None:
            # Built beside the entry and renamed into place whole: a session killed half-way
            # leaves only a ``.build-*`` directory behind.
            staging = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
            staging.chmod(0o755)
            try:
                built = build_runtime(staging, profile)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            try:
                staging.rename(keyed)
                found = keyed / built.relative_to(staging)
            except OSError:
                # an entry made meanwhile by a session that took no lock of this name (an
                # older checkout's): its build is as good as this one's
                shutil.rmtree(staging, ignore_errors=True)
                found = _found(keyed)
                if found is None:
                    raise
    check_trusted(found)  # a guest and the deploy tests run it as root
    os.utime(keyed)  # in use: .ci/run prunes what no run used for a week
    return found


if __name__ == "__main__":  # .ci/run: build both before the sessions need them
    print(f"built from {runtime_python()[0]}: {runtime_python()[1].splitlines()[0]}")
    print(cached_runtime())
    print(cached_runtime(profile="node"))

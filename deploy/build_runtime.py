"""Build flexhub's relocatable node runtime: one directory that runs on a node with no Python.

    python3 deploy/build_runtime.py OUT_DIR        # prints the runtime directory it made
    python3 deploy/build_runtime.py OUT_DIR --with flexhub-backend-mystore --with ./x.whl

The directory holds the interpreter, its standard library, flexhub, the four backends and
their dependencies, every shared library they load (glibc included) and glibc's own dynamic
loader. It is started as ``lib/ld-linux-x86-64.so.2 --library-path lib bin/python3.11``: the
bundled loader resolves every library inside the runtime, the node's libc and libraries are
never loaded, and, unlike ``LD_LIBRARY_PATH``, the library path is not inherited by the
commands flexhub runs (mount, losetup, iscsiadm are the node's own, with its environment).
Bytecode is compiled at build time with unchecked hashes, so a read-only copy starts fast.

``--profile`` picks what the runtime is for. ``full`` (the default) serves every command: the
provisioner and the node agent need the ``kubernetes`` client, ``flexhub csi`` needs grpcio and
protobuf (the ``csi`` extra), both here. ``node`` is the FlexVolume driver alone, what
``flexhub daemonset`` installs on a node without the node agent: the ``kubernetes`` client and
every distribution only it needs are left out (about 160 MB of the full runtime), and so is
the ``csi`` extra; a command that needs them says so in one line.

``--with PACKAGE_OR_WHEEL`` (repeatable) installs more distributions into the runtime beside
flexhub and its four backends, the way a third-party backend reaches nodes: a package name
pip can fetch, a wheel, or a project directory. They are part of the runtime's content, so of
its name and of the image built from it.

The runtime is built from the interpreter that runs this script (3.11, shared or static
libpython) and installs flexhub from this checkout with pip; the name of the directory is
``flexhub-<version>-<digest of its content>``, so two different builds never collide. The
local projects' wheels are built with this interpreter's own setuptools when it can build them
as an isolated build would (:func:`_builds_in_place`; about 40 % less of pip's time), else in
a fresh build environment per project; their dependencies are installed as pip always does.

Every kubelet call starts this interpreter, so build with an optimized one: a distribution's
``python3.11`` (Debian's package is built with PGO and LTO on amd64, per its packaging, and has
libpython linked into the executable) ran a pure-Python loop 1.6 times as fast as pyenv's
(built without ``--enable-optimizations``, with a shared libpython) on the CI machine, and
starts in half the time in the test rig's emulated guest. The distribution's own hooks in its
standard library (:data:`SKIP_STDLIB_HOOKS`) are left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("loopfile", "nfs", "iscsi", "cifs")
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
LOADER = "ld-linux-x86-64.so.2"
MARKER = "flexhub-runtime.json"
#: Standard-library parts a driver never uses (GUI, tests, installers).
SKIP_STDLIB = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
    "dist-packages", "__pycache__", "pydoc_data", "unittest",
}  # fmt: skip
#: What a distribution adds to its interpreter's standard library for the machine it was
#: installed on, not part of CPython: Debian's ``sitecustomize.py`` (a link into ``/etc``
#: that hooks apport) and its PEP 668 ``EXTERNALLY-MANAGED``. A runtime runs on other
#: machines; a ``sitecustomize`` would also make every driver call start Python with ``site``.
SKIP_STDLIB_HOOKS = {"sitecustomize.py", "EXTERNALLY-MANAGED"}
#: Standard-library directories by prefix: ``config-3.11-<arch>`` holds the static libpython
#: and the Makefile for building extensions (about 44 MB), which a runtime never does.
SKIP_STDLIB_PREFIXES = ("config-",)
PROFILES = ("full", "node")
#: What the ``node`` profile leaves out: the core's requirements the FlexVolume driver never
#: imports (the kubelet path is checked for that: tests/core's importtime test).
NODE_DROPS = frozenset({"kubernetes"})
SKIP_EXTENSIONS = ("_tkinter", "_test", "xxlimited", "_ctypes_test", "_xxtestfuzz")

LAUNCHER = """#!/bin/sh
# flexhub's runtime launcher (for people; kubelet runs the shim in its plugin directory).
RT=$(cd "$(dirname "$0")/.." && pwd -P)
exec "$RT/lib/{loader}" --library-path "$RT/lib" "$RT/bin/{python}" -I -m flexhub "$@"
"""


def _say(started: float, what: str) -> None:
    """A progress line on stderr (stdout carries only the runtime's path)."""
    print(
        f"build_runtime: {time.monotonic() - started:5.0f} s  {what}", file=sys.stderr, flush=True
    )


def _run(argv: list[str], **kwargs: object) -> None:
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]


def _needed(elf: Path) -> dict[str, Path]:
    """The shared libraries ``elf`` loads (ldd), by file name, and the loader itself."""
    proc = subprocess.run(["ldd", str(elf)], capture_output=True, text=True, check=False)
    found: dict[str, Path] = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            found[Path(parts[0]).name] = Path(parts[2])
        elif parts and parts[0].startswith("/") and LOADER in parts[0]:
            found[LOADER] = Path(parts[0])
    return found


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"\x7fELF"
    except OSError:
        return False


def _copy_stdlib(source: Path, target: Path) -> None:
    def ignore(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == source
        skipped = {
            n
            for n in names
            if top
            and (n in SKIP_STDLIB or n in SKIP_STDLIB_HOOKS or n.startswith(SKIP_STDLIB_PREFIXES))
        }
        skipped |= {n for n in names if n == "__pycache__"}
        skipped |= {n for n in names if n.startswith(SKIP_EXTENSIONS) and n.endswith(".so")}
        return skipped

    shutil.copytree(source, target, ignore=ignore, symlinks=False)


#: Where a runtime's ``site`` may look for distributions, relative to its ``lib/python3.X``:
#: CPython's own ``site-packages``, or ``dist-packages`` where a distribution patched ``site``
#: (Debian's looks in ``<prefix>/lib/python3.X/dist-packages`` and two more of its prefix,
#: the runtime's own directory, never the node's).
SITE_DIRS = ("site-packages", "dist-packages")


def _site_dir(rt: Path) -> Path:
    """The directory the runtime's interpreter, as copied into ``rt`` with its standard
    library, reads distributions from: the first of :data:`SITE_DIRS` its ``site`` names."""
    lib = rt / "lib" / PYVER
    ask = "import site; print(*site.getsitepackages(), sep='\\n')"
    proc = subprocess.run(
        [str(rt / "bin" / PYVER), "-I", "-c", ask],
        capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    named = {Path(os.path.realpath(line)) for line in proc.stdout.splitlines() if line}
    for name in SITE_DIRS:
        if Path(os.path.realpath(lib / name)) in named:
            return lib / name
    raise SystemExit(
        f"build_runtime: this interpreter's site reads none of {', '.join(SITE_DIRS)} in "
        f"{lib}: {proc.stdout.strip() or 'nothing'}"
    )


#: What pip and setuptools leave in a source tree (a wheel built there reuses ``build/lib``,
#: so a module deleted from the sources would still be installed from it).
BUILD_LEFTOVERS = shutil.ignore_patterns(
    "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache"
)


def _clean_copy(project: Path, dest: Path) -> str:
    """A project directory given to ``--with``, copied without build leftovers."""
    shutil.copytree(project, dest, ignore=BUILD_LEFTOVERS)
    return str(dest)


def _clean_sources(dest: Path) -> tuple[Path, list[Path]]:
    """Copy the core's and the backends' sources, without build leftovers, to ``dest``; the
    copies of the core project and of each backend project, to install from."""
    core = dest / "flexhub-src"
    core.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, core / name)
    shutil.copytree(REPO / "flexhub", core / "flexhub", ignore=BUILD_LEFTOVERS)
    backends = []
    for backend in BACKENDS:
        copy = dest / f"backend-{backend}"
        shutil.copytree(REPO / "backends" / backend, copy, ignore=BUILD_LEFTOVERS)
        backends.append(copy)
    return core, backends


#: The setuptools that builds a wheel by itself (``bdist_wheel`` in it; before 70.1 it also
#: needs the ``wheel`` distribution, which an isolated build installs and one in place may lack).
SELF_CONTAINED_SETUPTOOLS = "70.1"


def _builds_in_place(projects: list[Path], python: str) -> bool:
    """Whether the local projects (flexhub, the backends, ``--with`` directories) may be built
    into wheels with this interpreter's own setuptools (``pip wheel --no-build-isolation``)
    instead of a fresh build environment per project, which installs setuptools into each
    (40 % of pip's time here). Only when pip runs under this very interpreter, it has
    ``packaging`` and a setuptools of at least :data:`SELF_CONTAINED_SETUPTOOLS`, and every
    project declares ``setuptools.build_meta`` and requirements that it has (no extras, no
    markers). Their dependencies are installed as before (a dependency pip builds from an sdist
    gets its own build environment)."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import Version
    except ImportError:
        return False
    if os.path.abspath(python) != os.path.abspath(sys.executable):
        return False  # another venv of the same base is another set of distributions
    try:
        if Version(version("setuptools")) < Version(SELF_CONTAINED_SETUPTOOLS):
            return False
        for project in projects:
            table = tomllib.loads((project / "pyproject.toml").read_text("utf-8"))
            system = table.get("build-system", {})
            if system.get("build-backend") != "setuptools.build_meta":
                return False
            for text in system.get("requires", []):
                requirement = Requirement(text)
                if requirement.extras or requirement.marker is not None:
                    return False
                if not requirement.specifier.contains(version(requirement.name), prereleases=True):
                    return False
    except (OSError, ValueError, TypeError, InvalidRequirement, PackageNotFoundError):
        return False  # unreadable or unusual: pip's isolated build decides, as before
    return True


def _local_wheels(projects: list[Path], python: str, into: Path) -> dict[Path, Path]:
    """Build each local project's wheel in place (:func:`_builds_in_place`); its wheel by
    project."""
    import tomllib

    _run([python, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--no-build-isolation", "--wheel-dir", str(into), *(str(p) for p in projects)],
         env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"})  # fmt: skip
    wheels: dict[Path, Path] = {}
    for project in projects:
        name = tomllib.loads((project / "pyproject.toml").read_text("utf-8"))["project"]["name"]
        found = [
            w for w in into.glob("*.whl") if _canonical(w.name.split("-")[0]) == _canonical(name)
        ]
        if len(found) != 1:
            raise SystemExit(f"build_runtime: pip wheel made {len(found)} wheels of {name}")
        wheels[project] = found[0]
    return wheels


def _drop_direct_urls(site: Path) -> None:
    """Remove pip's ``direct_url.json`` (where each project was installed from: a path of the
    build machine, here a temporary one) and its line in ``RECORD``, so that the runtime's
    content, and so its name, depends only on what was installed."""
    for record in site.glob("*.dist-info/RECORD"):
        direct = record.parent / "direct_url.json"
        if not direct.exists():
            continue
        direct.unlink()
        name = f"{record.parent.name}/direct_url.json,"
        lines = record.read_text("utf-8").splitlines(keepends=True)
        record.write_text("".join(line for line in lines if not line.startswith(name)), "utf-8")


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _prune(site: Path, drops: frozenset[str]) -> list[str]:
    """Remove ``drops`` (required by flexhub's core only) and every distribution that nothing
    else installed needs; return what was removed. Distributions nothing requires are the
    roots (flexhub, its backends, ``--with`` ones); a root or any other distribution that
    itself requires a dropped one keeps it."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a distribution's interpreter may have pip alone, which vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]

    dists: dict[str, tuple[Path, set[str]]] = {}
    for info in site.glob("*.dist-info"):
        name, requires = "", set()
        for line in (info / "METADATA").read_text("utf-8").splitlines():
            if line.startswith("Name: "):
                name = _canonical(line[6:].strip())
            elif line.startswith("Requires-Dist: "):
                req = Requirement(line[len("Requires-Dist: ") :])
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    requires.add(_canonical(req.name))
        dists[name] = (info, requires)
    if "flexhub" not in dists:
        raise SystemExit("build_runtime: flexhub is not in the runtime it built")
    edges = {name: set(requires) for name, (_, requires) in dists.items()}
    required = set().union(*edges.values())  # before the drop: a dropped one is no root
    edges["flexhub"] -= drops
    keep: set[str] = set()
    todo = [name for name in dists if name not in required or name == "flexhub"]
    while todo:
        name = todo.pop()
        if name in keep or name not in dists:
            continue
        keep.add(name)
        todo.extend(edges[name])
    removed = sorted(set(dists) - keep)
    for name in removed:
        info = dists[name][0]
        for row in (info / "RECORD").read_text("utf-8").splitlines():
            path = site / row.split(",", 1)[0]
            if path.resolve().is_relative_to(site.resolve()) and path.is_file():
                path.unlink()
        shutil.rmtree(info, ignore_errors=True)
    for directory in sorted(site.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # the packages' emptied directories
    return removed


def build(out_dir: Path, python: str = sys.executable, extras: tuple[str, ...] = (),
          profile: str = "full") -> Path:  # fmt: skip
    """Build the runtime under ``out_dir`` and return its directory; ``extras`` are more
    distributions to install into it (``--with``); ``profile`` is ``full`` or ``node``."""
    if profile not in PROFILES:
        raise SystemExit(f"build_runtime: --profile {profile!r}: expected full or node")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _say(started, f"building the {profile} runtime in {out_dir}")
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
    try:
        rt = work / "runtime"
        (rt / "bin").mkdir(parents=True)
        (rt / "lib").mkdir()
        real_python = Path(os.path.realpath(python))
        shutil.copy2(real_python, rt / "bin" / PYVER)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        _copy_stdlib(stdlib, rt / "lib" / PYVER)
        site = _site_dir(rt)
        # From a clean copy: exactly the checkout's sources, and nothing is written into it.
        core, backends = _clean_sources(work / "src")
        extras = tuple(
            _clean_copy(Path(extra), work / "src" / f"with-{i}") if Path(extra).is_dir() else extra
            for i, extra in enumerate(extras)
        )
        local = [core, *backends, *(Path(extra) for extra in extras if Path(extra).is_dir())]
        sources: dict[Path, Path] = {project: project for project in local}
        if _builds_in_place(local, python):
            _say(started, "building flexhub and its backends with this interpreter's setuptools")
            sources = _local_wheels(local, python, work / "wheels")
        _say(started, "installing flexhub, its backends and their dependencies (pip)")
        _run(
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-compile", "--no-warn-script-location", "--no-warn-conflicts",
             "--target", str(site),
             f"{sources[core]}[csi]" if profile == "full" else str(sources[core]),
             *(str(sources[b]) for b in backends),
             *(str(sources.get(Path(extra), extra)) for extra in extras)],
            env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"},
        )  # fmt: skip
        if profile == "node":
            removed = _prune(site, NODE_DROPS)
            _say(started, f"left out of the node profile: {', '.join(removed) or 'nothing'}")
        _drop_direct_urls(site)
        # The shared libpython comes in with the interpreter's own needs (ldd of bin/), under
        # the one name it is loaded by (not also as the libpython3.11.so link-time name).
        _say(started, "copying the shared libraries they load")
        libraries: dict[str, Path] = {}
        for path in sorted(rt.rglob("*")):
            if (
                path.is_file()
                and (path.suffix == ".so" or ".so." in path.name or path.parent.name == "bin")
                and _is_elf(path)
            ):
                libraries.update(_needed(path))
        for name, source in sorted(libraries.items()):
            if not (rt / "lib" / name).exists():
                shutil.copy2(source, rt / "lib" / name, follow_symlinks=True)
        if not (rt / "lib" / LOADER).exists():
            raise SystemExit(f"build_runtime: no {LOADER} found by ldd")
        (rt / "bin" / "flexhub").write_text(LAUNCHER.format(loader=LOADER, python=PYVER))
        (rt / "bin" / "flexhub").chmod(0o755)
        runner = [
            str(rt / "lib" / LOADER),
            "--library-path",
            str(rt / "lib"),
            str(rt / "bin" / PYVER),
        ]
        _say(started, "byte-compiling")
        _run([*runner, "-I", "-m", "compileall", "-q", "-j", "0",
              "--invalidation-mode", "unchecked-hash", str(rt / "lib" / PYVER)],
             stdout=subprocess.DEVNULL)  # fmt: skip
        flexhub_version = _flexhub_version(site)
        needs_site = site_needs(rt / "lib" / PYVER, site)
        if needs_site:
            _say(started, f"{', '.join(needs_site)}: the driver will start Python with site")
        start = {} if needs_site else {"site_packages": str(site.relative_to(rt))}
        digest = _digest(rt, start)
        kind = "flexhub" if profile == "full" else f"flexhub-{profile}"
        name = f"{kind}-{flexhub_version}-{digest[:12]}"
        marker = {
            "version": flexhub_version,
            "build": digest,
            "name": name,
            "profile": profile,
            "python": f"bin/{PYVER}",
            "loader": f"lib/{LOADER}",
            "library_path": "lib",
        }
        marker.update(start)
        (rt / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        final = out_dir / name
        if final.exists():
            shutil.rmtree(final)
        rt.rename(final)
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file()) >> 20
        _say(started, f"done: {final} ({size} MiB)")
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def site_needs(stdlib: Path, site: Path) -> list[str]:
    """What :mod:`site` would run in this runtime besides putting ``site`` on ``sys.path``:
    ``.pth`` files in ``site``, a ``sitecustomize`` there or in ``stdlib`` (``-I`` already
    leaves out ``usercustomize``). With none, the marker names ``site`` (``site_packages``) and
    the driver's shim starts Python without site, putting that directory on ``sys.path`` itself
    (:mod:`flexhub.admin.install`)."""
    found = sorted(path.name for path in site.glob("*.pth"))
    for directory in (stdlib, site):
        found += sorted(str(p.relative_to(stdlib)) for p in directory.glob("sitecustomize*"))
    return found


def _flexhub_version(site: Path) -> str:
    for dist in site.glob("flexhub-*.dist-info"):
        for line in (dist / "METADATA").read_text().splitlines():
            if line.startswith("Version: "):
                return line.split(": ", 1)[1].strip()
    return "0"


def _digest(root: Path, start: Mapping[str, str]) -> str:
    """A digest of every file's path and content (the runtime's identity) and of the marker's
    ``start`` fields, which change how a shim starts it: a node that holds an older build of
    the same files under the same name would keep starting it the older way."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    if start:
        h.update(json.dumps(dict(start), sort_keys=True).encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="build_runtime.py", description="Build flexhub's relocatable node runtime."
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", type=Path)
    parser.add_argument(
        "--with",
        dest="extras",
        action="append",
        default=[],
        metavar="PACKAGE_OR_WHEEL",
        help="another distribution to install (a third-party backend); repeatable",
    )
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default="full",
        help="full: every command (default); node: the FlexVolume driver alone, no API client",
    )
    args = parser.parse_args(argv)
    if str(args.out_dir).startswith("-"):
        parser.error("OUT_DIR must not start with '-'")
    try:
        print(build(args.out_dir, extras=tuple(args.extras), profile=args.profile))
    except subprocess.CalledProcessError as exc:
        step = " ".join(str(word) for word in exc.cmd)
        raise SystemExit(f"build_runtime: failed (exit {exc.returncode}): {step[:400]}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())

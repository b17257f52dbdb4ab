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

``--with PACKAGE_OR_WHEEL`` (repeatable) installs more distributions into the runtime beside
flexhub and its four backends, the way a third-party backend reaches nodes: a package name
pip can fetch, a wheel, or a project directory. They are part of the runtime's content, so of
its name and of the image built from it.

The runtime is built from the interpreter that runs this script (3.11, shared or static
libpython) and installs flexhub from this checkout with pip; the name of the directory is
``flexhub-<version>-<digest of its content>``, so two different builds never collide.
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("loopfile", "nfs", "iscsi", "cifs")
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
LOADER = "ld-linux-x86-64.so.2"
MARKER = "flexhub-runtime.json"
#: Standard-library parts a driver never uses (GUI, tests, installers).
SKIP_STDLIB = {
    "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
    "__pycache__", "pydoc_data", "unittest",
}  # fmt: skip
SKIP_EXTENSIONS = ("_tkinter", "_test", "xxlimited", "_ctypes_test", "_xxtestfuzz")

LAUNCHER = """#!/bin/sh
# flexhub's runtime launcher (for people; kubelet runs the shim in its plugin directory).
RT=$(cd "$(dirname "$0")/.." && pwd -P)
exec "$RT/lib/{loader}" --library-path "$RT/lib" "$RT/bin/{python}" -I -m flexhub "$@"
"""


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
        skipped = {n for n in names if n in SKIP_STDLIB and Path(directory) == source}
        skipped |= {n for n in names if n == "__pycache__"}
        skipped |= {n for n in names if n.startswith(SKIP_EXTENSIONS) and n.endswith(".so")}
        return skipped

    shutil.copytree(source, target, ignore=ignore, symlinks=False)


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


def build(out_dir: Path, python: str = sys.executable, extras: tuple[str, ...] = ()) -> Path:
    """Build the runtime under ``out_dir`` and return its directory; ``extras`` are more
    distributions to install into it (``--with``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir))
    try:
        rt = work / "runtime"
        (rt / "bin").mkdir(parents=True)
        (rt / "lib").mkdir()
        real_python = Path(os.path.realpath(python))
        shutil.copy2(real_python, rt / "bin" / PYVER)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        _copy_stdlib(stdlib, rt / "lib" / PYVER)
        site = rt / "lib" / PYVER / "site-packages"
        # From a clean copy: exactly the checkout's sources, and nothing is written into it.
        core, backends = _clean_sources(work / "src")
        extras = tuple(
            _clean_copy(Path(extra), work / "src" / f"with-{i}") if Path(extra).is_dir() else extra
            for i, extra in enumerate(extras)
        )
        _run(
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-compile", "--no-warn-script-location", "--target", str(site),
             str(core), *(str(b) for b in backends), *extras],
            env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"},
        )  # fmt: skip
        _drop_direct_urls(site)
        libpython = sysconfig.get_config_var("LDLIBRARY") or ""
        libdir = Path(sysconfig.get_config_var("LIBDIR") or "/nonexistent")
        if libpython.endswith(".so") or ".so." in libpython:
            for candidate in libdir.glob(libpython + "*"):
                shutil.copy2(candidate, rt / "lib" / candidate.name, follow_symlinks=True)
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
        _run([*runner, "-I", "-m", "compileall", "-q", "-j", "0",
              "--invalidation-mode", "unchecked-hash", str(rt / "lib" / PYVER)],
             stdout=subprocess.DEVNULL)  # fmt: skip
        flexhub_version = _flexhub_version(site)
        digest = _digest(rt)
        name = f"flexhub-{flexhub_version}-{digest[:12]}"
        (rt / MARKER).write_text(
            json.dumps(
                {"version": flexhub_version, "build": digest, "name": name,
                 "python": f"bin/{PYVER}", "loader": f"lib/{LOADER}", "library_path": "lib"},
                indent=1, sort_keys=True,
            ) + "\n"
        )  # fmt: skip
        final = out_dir / name
        if final.exists():
            shutil.rmtree(final)
        rt.rename(final)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _flexhub_version(site: Path) -> str:
    for dist in site.glob("flexhub-*.dist-info"):
        for line in (dist / "METADATA").read_text().splitlines():
            if line.startswith("Version: "):
                return line.split(": ", 1)[1].strip()
    return "0"


def _digest(root: Path) -> str:
    """A digest of every file's path and content (the runtime's identity)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
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
    args = parser.parse_args(argv)
    if str(args.out_dir).startswith("-"):
        parser.error("OUT_DIR must not start with '-'")
    try:
        print(build(args.out_dir, extras=tuple(args.extras)))
    except subprocess.CalledProcessError as exc:
        step = " ".join(str(word) for word in exc.cmd)
        raise SystemExit(f"build_runtime: failed (exit {exc.returncode}): {step[:400]}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())

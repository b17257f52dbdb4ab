"""The relocatable runtime serves kubelet with every Python of the host hidden, loads no
library from outside itself, and `flexhub daemonset` installs and upgrades it atomically on a
host root (a real mount namespace with the host's /usr bind-mounted and its Pythons masked)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import needs_root
from tests.deploy.conftest import LOOP_OPTIONS, fake_host, in_namespace

pytestmark = needs_root


@pytest.fixture(params=["full", "node"])
def node(request: pytest.FixtureRequest, tmp_path: Path,
         trusted_dir: Path) -> Iterator[dict[str, Path]]:  # fmt: skip
    """A node whose driver runs from the full runtime, then from the node profile's."""
    runtime: Path = request.getfixturevalue(
        "runtime" if request.param == "full" else "node_runtime"
    )
    tree = {name: tmp_path / name for name in ("state", "log", "loop", "kubelet")}
    tree["plugins"] = trusted_dir / "plugins"  # install refuses one below /tmp
    config = tmp_path / "flexhub.toml"
    config.write_text(
        f'state_dir = "{tree["state"]}"\nlog_dir = "{tree["log"]}"\n'
        f'[loopfile]\nroot = "{tree["loop"]}"\n'
    )
    subprocess.run(
        [str(runtime / "bin" / "flexhub"), "install", "--plugin-dir", str(tree["plugins"]),
         "--config", str(config)],
        check=True, capture_output=True,
    )  # fmt: skip
    tree["driver"] = tree["plugins"] / "k8s~flexhub" / "flexhub"
    tree["runtime"] = runtime
    tree["target"] = tree["kubelet"] / "pods/u1/volumes/k8s~flexhub/pv"
    tree["target"].mkdir(parents=True)
    yield tree
    subprocess.run([str(tree["driver"]), "unmount", str(tree["target"])], capture_output=True)


def test_the_shim_runs_the_runtime_through_its_own_loader(node: dict[str, Path]) -> None:
    runtime = node["runtime"]
    text = node["driver"].read_text()
    assert f"exec {runtime}/lib/ld-linux-x86-64.so.2 --library-path {runtime}/lib " in text
    assert "LD_LIBRARY_PATH" not in text


def test_the_shim_starts_without_site_and_finds_what_site_would(node: dict[str, Path]) -> None:
    """The runtime holds no .pth file or sitecustomize, so its shim starts Python with ``-S`` and puts
    site-packages on ``sys.path`` itself: the same ``sys.path`` that site gives, in order."""
    runtime = node["runtime"]
    marker = json.loads((runtime / "flexhub-runtime.json").read_text())
    # site-packages, or dist-packages in a runtime of Debian's interpreter (its site reads that)
    assert marker["site_packages"] in {
        "lib/python3.11/site-packages",
        "lib/python3.11/dist-packages",
    }
    assert (runtime / marker["site_packages"] / "flexhub" / "__init__.py").is_file()
    assert not list((runtime / marker["site_packages"]).glob("*.pth"))
    # nor a distribution's hooks in its standard library (Debian's sitecustomize links to /etc)
    assert not list(runtime.glob("lib/python3.11/sitecustomize*"))
    assert not list(runtime.glob("lib/python3.11/EXTERNALLY-MANAGED"))
    text = node["driver"].read_text()
    assert "/bin/python3.11 -I -S -c 'import sys\n" in text
    prelude = text.split(" -I -S -c '", 1)[1].split("\ntry:\n", 1)[0]
    start = [str(runtime / marker["loader"]), "--library-path", str(runtime / "lib"),
             str(runtime / marker["python"])]  # fmt: skip
    probe = (
        "import json, flexhub\nprint(json.dumps([sys.path, sys.flags.no_site, flexhub.__file__]))"
    )
    seen = []
    for flags, head in ((["-I", "-S"], prelude), (["-I"], "import sys")):
        argv = [*start, *flags, "-c", f"{head}\n{probe}"]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd="/", env={})
        seen.append(json.loads(out.stdout))
    without, with_site = seen
    assert with_site[1] == 0 and without[1] == 1  # site ran, then did not
    assert without[0] == with_site[0] and without[2] == with_site[2]
    assert with_site[2].startswith(f"{runtime}/{marker['site_packages']}/")


def test_init_mount_unmount_with_every_host_python_hidden(node: dict[str, Path]) -> None:
    driver, target = node["driver"], node["target"]
    result = in_namespace(
        f"""
        for p in $(compgen -c python | sort -u) {sys.executable}; do
            if "$p" -c pass 2>/dev/null; then echo "python runs: $p"; exit 1; fi
        done
        K="env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8"
        echo "init $($K {driver} init)"
        echo "mount $($K {driver} mount {target} '{json.dumps(LOOP_OPTIONS)}')"
        echo "fs $(findmnt -n -o FSTYPE {target})"
        echo data > {target}/file
        echo "unmount $($K {driver} unmount {target})"
        echo "after $(findmnt -n {target} || echo none)"
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert json.loads(lines["init"])["capabilities"]["attach"] is False
    assert json.loads(lines["mount"]) == {"status": "Success"}
    assert lines["fs"] == "ext4"
    assert json.loads(lines["unmount"]) == {"status": "Success"}
    assert lines["after"] == "none"


def test_the_running_driver_maps_no_library_of_the_node(
    node: dict[str, Path], tmp_path: Path
) -> None:
    driver, target, runtime = node["driver"], node["target"], node["runtime"]
    real = shutil.which("losetup")
    assert real is not None
    saved = tmp_path / "losetup.real"
    shutil.copy2(real, saved)
    slow = tmp_path / "losetup.slow"
    slow.write_text(f'#!/bin/bash\nenv > {tmp_path}/child-env\nsleep 2\nexec {saved} "$@"\n')
    slow.chmod(0o755)
    result = in_namespace(
        f"""
        mount --bind {slow} {real}
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin {driver} mount {target} '{json.dumps(LOOP_OPTIONS)}' > {tmp_path}/reply &
        pid=$!
        sleep 1.2
        cat /proc/$pid/maps > {tmp_path}/maps
        wait $pid
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin {driver} unmount {target} > /dev/null
        """
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "reply").read_text()) == {"status": "Success"}
    libraries = {
        line.split()[-1]
        for line in (tmp_path / "maps").read_text().splitlines()
        if ".so" in line.split()[-1]
    }
    # the interpreter's own code: in its shared libpython, or linked into bin/python3.11
    assert any("libpython" in lib for lib in libraries) == _shared_libpython(runtime)
    assert any("ld-linux" in lib for lib in libraries)
    outside = sorted(lib for lib in libraries if not lib.startswith(f"{runtime}/"))
    assert outside == []
    child_env = (tmp_path / "child-env").read_text()
    assert "LD_LIBRARY_PATH" not in child_env
    assert "PATH=/usr/sbin:/usr/bin:/sbin:/bin" in child_env.splitlines()


def daemonset(runtime: Path, host: Path, extra: str = "") -> str:
    return (
        f"{runtime}/bin/flexhub daemonset --once --host-root {host} --plugin-dir /plugins "
        f"--config /etc/flexhub/flexhub.toml {extra}"
    )


def test_daemonset_installs_and_upgrades_atomically(runtime: Path, tmp_path: Path) -> None:
    host, mounts = fake_host(tmp_path)
    second = tmp_path / "second"
    shutil.copytree(runtime, second, symlinks=True)
    marker = json.loads((second / "flexhub-runtime.json").read_text())
    marker["name"] = marker["name"] + "-next"
    (second / "flexhub-runtime.json").write_text(json.dumps(marker))
    third = tmp_path / "third"
    shutil.copytree(runtime, third, symlinks=True)
    marker["name"] = marker["name"] + "-last"
    (third / "flexhub-runtime.json").write_text(json.dumps(marker))
    runtimes = host / "var/lib/flexhub/runtime"
    shim = host / "plugins/k8s~flexhub/flexhub"
    configmap = tmp_path / "configmap" / "flexhub.toml"  # as the chart mounts it in the pod
    configmap.parent.mkdir()
    configmap.write_text('log_level = "debug"\n[loopfile]\nroot = "/var/lib/flexhub/lf"\n')
    result = in_namespace(
        f"""
        {mounts}
        echo "first $({daemonset(runtime, host)})"
        echo "init1 $(chroot {host} env -i PATH=/usr/bin:/bin /plugins/k8s~flexhub/flexhub init)"
        echo "second $({daemonset(second, host)})"
        # a call still running on the first runtime keeps it
        {runtimes}/{runtime.name}/bin/flexhub version > /dev/null
        {runtimes}/{runtime.name}/lib/ld-linux-x86-64.so.2 --library-path {runtimes}/{runtime.name}/lib {runtimes}/{runtime.name}/bin/python3.11 -I -c 'import time; time.sleep(20)' &
        busy=$!
        sleep 0.5
        echo "third $({daemonset(third, host)})"
        kill $busy
        wait $busy || true
        echo "fourth $({daemonset(third, host, f"--config-from {configmap}")})"
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    first, second_run = json.loads(lines["first"]), json.loads(lines["second"])
    third_run, fourth = json.loads(lines["third"]), json.loads(lines["fourth"])
    assert first["runtime"] == f"/var/lib/flexhub/runtime/{runtime.name}"
    assert first["driver"] == "/plugins/k8s~flexhub/flexhub"
    assert "explicit" in first["plugin_dir"]
    assert json.loads(lines["init1"])["status"] == "Success"
    assert second_run["runtime"].endswith("-next") and second_run["removed"] == []
    # the oldest runtime was in use: kept; once free, removed; the previous one always stays
    assert third_run["removed"] == []
    assert fourth["removed"] == [f"/var/lib/flexhub/runtime/{runtime.name}"], (third_run, fourth)
    assert sorted(p.name for p in runtimes.iterdir()) == sorted(
        [marker["name"], marker["name"].removesuffix("-last")]
    )
    text = shim.read_text()
    assert f"/var/lib/flexhub/runtime/{marker['name']}/bin/python3.11" in text
    assert "FLEXHUB_CONFIG=/etc/flexhub/flexhub.toml" in text
    assert [p.name for p in shim.parent.iterdir()] == ["flexhub"]  # no temporary left
    # --config-from wrote the ConfigMap's config where the shim reads it on the host
    placed = host / "etc/flexhub/flexhub.toml"
    assert placed.read_text() == configmap.read_text()
    assert placed.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in placed.parent.iterdir()] == ["flexhub.toml"]


def test_the_runtime_and_its_flexhub_agree_on_the_version(runtime: Path) -> None:
    import flexhub

    marker = json.loads((runtime / "flexhub-runtime.json").read_text())
    assert marker["version"] == flexhub.__version__
    assert marker["name"].startswith(f"flexhub-{flexhub.__version__}-")
    proc = subprocess.run(
        [str(runtime / "bin" / "flexhub"), "--version"], capture_output=True, text=True, check=False
    )
    assert proc.stdout == f"flexhub {flexhub.__version__}\n", proc.stderr


def test_a_third_party_backend_baked_in_with_with_reaches_the_node(
    runtime: Path, tmp_path: Path
) -> None:
    """`build_runtime.py --with` (the test runtime is built with the backend `flexhub
    new-backend mystore` writes): the runtime's own flexhub finds it through its entry point
    and checks its options against its schema, as the node's driver will."""
    pv = tmp_path / "pv.yaml"

    def validate(options: str) -> subprocess.CompletedProcess[str]:
        pv.write_text(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: pv-1}\n"
            "spec:\n  capacity: {storage: 1Gi}\n  accessModes: [ReadWriteOnce]\n"
            f"  flexVolume:\n    driver: k8s/flexhub\n    options: {options}\n"
        )
        return subprocess.run(
            [str(runtime / "bin" / "flexhub"), "validate", str(pv)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip

    good = validate("{backend: mystore, directory: data}")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = validate("{backend: mystore, direktory: data}")
    assert bad.returncode == 1
    assert "spec.flexVolume.options.direktory" in bad.stdout + bad.stderr
    sites = list((runtime / "lib").glob("python3*/*-packages/flexhub_mystore"))
    assert sites, "the backend is not in the runtime"


def test_the_runtime_holds_the_checkouts_sources_and_nothing_left_from_a_build(
    tmp_path: Path,
) -> None:
    """A module that is no longer in the sources but still in a backend's ``build/lib`` (what
    pip and setuptools leave in a source tree) does not reach the runtime, the build writes
    nothing into the checkout, and no path of the build machine is recorded in it (pip's
    ``direct_url.json``)."""
    from tests.conftest import REPO

    repo = tmp_path / "checkout"
    leftovers = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")
    repo.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, repo / name)
    for top in ("flexhub", "backends", "deploy"):
        shutil.copytree(REPO / top, repo / top, ignore=leftovers)
    stale = repo / "backends" / "nfs" / "build" / "lib" / "flexhub_nfs" / "_deleted_module.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("raise SystemExit('a module deleted from the sources')\n")
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    proc = subprocess.run(
        [sys.executable, str(repo / "deploy" / "build_runtime.py"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runtime = Path(proc.stdout.strip().splitlines()[-1])
    site = next(runtime.glob("lib/python3*/*-packages"))
    assert (site / "flexhub_nfs" / "__init__.py").is_file()
    assert not (site / "flexhub_nfs" / "_deleted_module.py").exists()
    assert not list(site.glob("*.dist-info/direct_url.json"))
    assert str(tmp_path) not in "".join(p.read_text() for p in site.glob("*.dist-info/RECORD"))
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before
    # Built from the tests' interpreter (the other runtimes here are the distribution's, when
    # it has one: tests/runtime_cache.py): it runs from its own directory too, with site.
    start = [str(runtime / "lib" / "ld-linux-x86-64.so.2"), "--library-path",
             str(runtime / "lib"), str(runtime / "bin" / "python3.11")]  # fmt: skip
    probe = "import flexhub_nfs; print(flexhub_nfs.__file__)"
    out = subprocess.run([*start, "-I", "-c", probe], capture_output=True, text=True,
                         check=True, cwd="/", env={}).stdout  # fmt: skip
    assert out.startswith(f"{site}/flexhub_nfs/")
    shared = ["libpython3.11.so.1.0"] if _shared_libpython(runtime) else []
    assert [p.name for p in (runtime / "lib").glob("libpython*")] == shared


def _distributions(runtime: Path) -> set[str]:
    infos = runtime.glob("lib/python3.11/*-packages/*.dist-info")
    return {info.name.split("-")[0].lower() for info in infos}


def _megabytes(root: Path) -> float:
    return (
        sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20
    )


def test_the_node_profile_leaves_out_the_api_client_and_says_so(
    runtime: Path, node_runtime: Path
) -> None:
    """The node runtime has the driver and its backends but not the kubernetes client (nor
    what only it needs) or the CSI packages; a command that needs them says so in one line.
    Both sizes are printed (the figures of docs/performance.md)."""
    full, lean = _distributions(runtime), _distributions(node_runtime)
    assert {"kubernetes", "grpcio", "protobuf", "aiohttp", "requests"} <= full
    assert not {"kubernetes", "grpcio", "protobuf", "aiohttp", "requests", "urllib3"} & lean
    assert {"flexhub", "flexhub_loopfile", "flexhub_nfs", "flexhub_iscsi", "flexhub_cifs",
            "stevedore", "jsonschema", "typer", "pyyaml"} <= lean  # fmt: skip
    assert json.loads((node_runtime / "flexhub-runtime.json").read_text())["profile"] == "node"
    for command in (["provisioner"], ["node-agent"], ["csi", "--node-id", "n"]):
        done = subprocess.run([str(node_runtime / "bin" / "flexhub"), *command],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert "needs the Python package" in lines[0] and "full" in lines[0], lines[0]
    print(
        f"\nruntime size: full {_megabytes(runtime):.0f} MiB, node {_megabytes(node_runtime):.0f} MiB"
    )


def _shared_libpython(runtime: Path) -> bool:
    """Whether the runtime's interpreter was built with a shared libpython (pyenv's is; a
    distribution's such as Debian's links it into the executable): what its loader lists."""
    marker = json.loads((runtime / "flexhub-runtime.json").read_text())
    argv = [str(runtime / marker["loader"]), "--list", "--library-path", str(runtime / "lib"),
            str(runtime / marker["python"])]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env={}).stdout
    return "libpython" in out


def test_a_runtime_carries_no_static_libpython_and_at_most_one_shared_one(runtime: Path) -> None:
    """No static libpython (``config-3.11-*``: 44 MB a runtime never links); the shared one
    exactly once, under the name the interpreter loads, if it has one."""
    assert not list((runtime / "lib").glob("python3*/config-*"))
    shared = ["libpython3.11.so.1.0"] if _shared_libpython(runtime) else []
    assert [p.name for p in (runtime / "lib").glob("libpython*")] == shared


def test_the_node_runtime_entrypoint_installs_a_working_driver(
    node_runtime: Path, tmp_path: Path
) -> None:
    """The lean image's entrypoint (``flexhub daemonset``, node agent off) needs no API
    client: it installs the node runtime and its shim, which answers ``init``."""
    host, mounts = fake_host(tmp_path)
    result = in_namespace(
        f"""
        {mounts}
        echo "installed $({daemonset(node_runtime, host)})"
        echo "init $(chroot {host} env -i PATH=/usr/bin:/bin /plugins/k8s~flexhub/flexhub init)"
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert (
        json.loads(lines["installed"])["runtime"] == f"/var/lib/flexhub/runtime/{node_runtime.name}"
    )
    assert json.loads(lines["init"])["status"] == "Success"


def test_the_build_says_what_it_does_and_the_docs_name_the_runtime_it_printed(
    node_runtime: Path,
) -> None:
    """build_runtime.py's progress goes to stderr (stdout is the runtime's path alone), and
    the documented commands take the path it printed: with two runtimes in ``out/`` (full and
    node) a glob ``out/flexhub-*/`` names both."""
    log = node_runtime.parent / "build.log"
    progress = log.read_text().splitlines()
    assert progress and all(line.startswith("build_runtime: ") for line in progress), progress
    said = "\n".join(progress)
    for step in ("installing flexhub", "left out of the node profile: ", "byte-compiling",
                 f"/{node_runtime.name} ("):  # fmt: skip
        assert step in said, (step, said)
    assert "kubernetes" in said.split("left out of the node profile: ")[1].splitlines()[0]
    repo = Path(__file__).resolve().parents[2]
    for doc in [repo / "README.md", *(repo / "docs").rglob("*.md")]:
        assert "--runtime out/flexhub-*" not in doc.read_text(), doc

"""The DaemonSet image: built by deploy/build_image.py with no container engine, unpacked by
umoci (an independent reader of the OCI layout), and its entrypoint run in a chroot of the
unpacked filesystem with the host's directories bind-mounted as the DaemonSet mounts them:
it installs a working driver into the plugin directory of a running "kubelet", and a newer
image upgrades it atomically."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, needs_root
from tests.deploy.conftest import fake_host, fake_kubelet, in_namespace

pytestmark = needs_root

sys.path.insert(0, str(REPO / "deploy"))
import build_image  # type: ignore[import-not-found]  # noqa: E402

PLUGINS = "/var/lib/kubelet/volumeplugins"


def unpack(layout: Path, tag: str, bundle: Path) -> dict[str, object]:
    subprocess.run(
        ["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)],
        check=True, capture_output=True,
    )  # fmt: skip
    config: dict[str, object] = json.loads((bundle / "config.json").read_text())
    return config


def renamed(runtime: Path, tmp_path: Path, suffix: str) -> Path:
    copy = tmp_path / f"runtime{suffix}"
    shutil.copytree(runtime, copy, symlinks=True)
    marker = json.loads((copy / "flexhub-runtime.json").read_text())
    marker["name"] += suffix
    (copy / "flexhub-runtime.json").write_text(json.dumps(marker))
    return copy


def test_image_layout_is_deterministic_and_readable(runtime: Path, tmp_path: Path) -> None:
    first = build_image.build_image(tmp_path / "a", runtime, "v1")
    second = build_image.build_image(tmp_path / "b", runtime, "v1")
    assert first["digest"] == second["digest"]
    config = unpack(tmp_path / "a", "v1", tmp_path / "bundle")
    args = config["process"]["args"]  # type: ignore[index]
    assert args[:3] == ["/opt/flexhub/runtime/lib/ld-linux-x86-64.so.2", "--library-path",
                        "/opt/flexhub/runtime/lib"]  # fmt: skip
    assert args[-3:] == ["daemonset", "--host-root", "/host"]
    rootfs = tmp_path / "bundle" / "rootfs"
    assert (rootfs / "opt/flexhub/runtime/flexhub-runtime.json").is_file()
    assert not (rootfs / "bin").exists()  # no shell, no distribution: only the runtime


def test_entrypoint_installs_and_upgrades_the_driver_on_the_host(
    runtime: Path, tmp_path: Path, trusted_dir: Path
) -> None:
    layout = tmp_path / "layout"
    build_image.build_image(layout, runtime, "v1")
    build_image.build_image(layout, renamed(runtime, tmp_path, "-v2"), "v2")
    bundles = {}
    for tag in ("v1", "v2"):
        config = unpack(layout, tag, tmp_path / f"bundle-{tag}")
        bundles[tag] = (tmp_path / f"bundle-{tag}" / "rootfs", config["process"]["args"])  # type: ignore[index]
    host, mounts = fake_host(tmp_path)
    (host / "var/lib/kubelet/volumeplugins").mkdir(parents=True)
    # the real kubelet, as far as the entrypoint can tell: root's process of a root-owned
    # executable called kubelet, which the host shows at the same path (bind-mounted there)
    exe = fake_kubelet(trusted_dir / "bin")
    (host / str(trusted_dir).lstrip("/")).mkdir(parents=True)
    mounts += f"\nmount --bind {trusted_dir} {host}{trusted_dir}\n"
    # started by the script, inside its pid namespace (its bash is pid 1: the kubelet shares
    # pid 1's root and mount namespace, as the host's does), and seen there before any step
    start = f"""
    {exe} -c 'sleep 120; :' kubelet --volume-plugin-dir={PLUGINS} &
    kubelet=$!
    trap 'kill $kubelet 2>/dev/null || true' EXIT
    for _ in $(seq 200); do
        tr '\\0' ' ' </proc/$kubelet/cmdline | grep -q -- --volume-plugin-dir && break
        sleep 0.05
    done
    tr '\\0' ' ' </proc/$kubelet/cmdline | grep -q -- --volume-plugin-dir \\
        || {{ echo "the fake kubelet never showed its command line" >&2; exit 1; }}
    """
    steps = []
    for tag, (rootfs, args) in bundles.items():
        for directory in ("host", "proc", "dev"):
            (rootfs / directory).mkdir(exist_ok=True)
        command = " ".join(f"'{a}'" for a in args)
        steps.append(
            f"""
            mount --rbind {host} {rootfs}/host
            mount --bind /proc {rootfs}/proc
            mount --bind /dev {rootfs}/dev
            echo "{tag} $(chroot {rootfs} {command} --once --config /etc/flexhub/flexhub.toml)"
            echo "probe-{tag} $(chroot {rootfs} {" ".join(args[:6])} flexhub doctor --probe --json --host-root /host --config /etc/flexhub/flexhub.toml | tr -d '\\n')"
            echo "init-{tag} $(chroot {host} env -i PATH=/usr/bin:/bin {PLUGINS}/k8s~flexhub/flexhub init)"
            """
        )
    result = in_namespace(mounts + start + "\n".join(steps), pid=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    v1, v2 = json.loads(lines["v1"]), json.loads(lines["v2"])
    assert v1["driver"] == f"{PLUGINS}/k8s~flexhub/flexhub"
    assert "kubelet command line" in v1["plugin_dir"]
    assert v2["runtime"] == v1["runtime"] + "-v2"
    for tag in ("v1", "v2"):
        assert json.loads(lines[f"init-{tag}"])["status"] == "Success"
        probe = json.loads(lines[f"probe-{tag}"])
        assert [c["name"] for c in probe if c["status"] == "fail"] == [], probe
    shim = (host / PLUGINS.lstrip("/") / "k8s~flexhub" / "flexhub").read_text()
    assert f"{v2['runtime']}/bin/python3.11" in shim
    assert sorted(p.name for p in (host / "var/lib/flexhub/runtime").iterdir()) == sorted(
        [Path(v1["runtime"]).name, Path(v2["runtime"]).name]
    )

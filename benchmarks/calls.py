"""Per-call cost of the installed driver, as kubelet pays it (prints figures; asserts nothing).

Run as root from a checkout where flexhub and flexhub-loopfile are installed::

    python3 benchmarks/calls.py [--runs 30]

It installs the driver into a temporary tree and measures wall time per call (median and
90th percentile) for ``init``, ``getvolumename``, ``unmount`` of a directory flexhub does
not know, and a full loopfile ``mount``/``unmount`` pair; then it lists the modules the
kubelet path imports for ``init`` and ``unmount``, with their cumulative import time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flexhub.harness import Kubelet, go_json
from flexhub.install import install


def timed(func: object, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        func()  # type: ignore[operator]
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def report(name: str, samples: list[float]) -> None:
    samples.sort()
    p90 = samples[int(len(samples) * 0.9) - 1] if len(samples) >= 10 else max(samples)
    print(f"{name:<34} median {statistics.median(samples):7.1f} ms   p90 {p90:7.1f} ms   n={len(samples)}")


def import_profile(args: list[str], config: Path) -> None:
    """Cumulative import time of the kubelet path (stderr is captured before flexhub runs)."""
    code = (
        "import os, sys\n"
        "from flexhub.__main__ import main\n"
        f"main({args!r})\n"
    )
    with tempfile.TemporaryFile() as err:
        subprocess.run(
            [sys.executable, "-I", "-X", "importtime", "-c", code],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "FLEXHUB_CONFIG": str(config)},
            cwd="/", check=False,
        )
        err.seek(0)
        lines = err.read().decode().splitlines()
    # lines after flexhub redirects fd 2 are lost, so also report sys.modules
    total = sum(int(line.split("|")[1]) for line in lines if line.startswith("import time:") and line.split("|")[1].strip().isdigit())
    print(f"  imports before stream protection: {total / 1000:.1f} ms self time")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory(prefix="flexhub-bench-") as tmp:
        root = Path(tmp)
        config = root / "flexhub.toml"
        config.write_text(
            f'state_dir = "{root / "state"}"\nlog_dir = "{root / "log"}"\n'
            f'[loopfile]\nroot = "{root / "loop"}"\n'
        )
        driver = install(root / "plugins", config=config)
        kubelet = Kubelet(driver=driver, root=root / "kubelet")
        print(f"python {sys.version.split()[0]} at {sys.executable}; {os.cpu_count()} cpus")
        report("init", timed(kubelet.init, runs))
        j = go_json(Kubelet.base_options({"backend": "loopfile", "file": "b.img"}, pv="pv"))
        report("getvolumename", timed(lambda: kubelet.call("getvolumename", j), runs))
        report("unmount (unknown dir)", timed(lambda: kubelet.call("unmount", str(root / "none")), runs))
        if os.geteuid() == 0:
            user = {"backend": "loopfile", "file": "bench.img", "size": "64Mi"}
            uid = kubelet.new_pod_uid()
            first = timed(lambda: kubelet.mount(uid, "pv", Kubelet.mount_options(user, pv="pv", pod_uid=uid)), 1)
            report("mount (create+mkfs ext4, first)", first)
            report("unmount (last user, detach)", timed(lambda: kubelet.unmount(uid, "pv"), 1))
            mounts, unmounts = [], []
            for _ in range(max(3, runs // 3)):
                uid = kubelet.new_pod_uid()
                opts = Kubelet.mount_options(user, pv="pv", pod_uid=uid)
                mounts += timed(lambda: kubelet.mount(uid, "pv", opts), 1)
                unmounts += timed(lambda: kubelet.unmount(uid, "pv"), 1)
            report("mount (existing fs: attach+fsck+mount)", mounts)
            report("unmount (last user: detach)", unmounts)
        for args in (["init"], ["unmount", str(root / "none")]):
            code = (
                "import sys\nfrom flexhub.__main__ import main\n"
                f"main({args!r})\n"
                f"open({str(root / 'mods')!r}, 'w').write('\\n'.join(sys.modules))\n"
            )
            subprocess.run([sys.executable, "-I", "-c", code], env={"FLEXHUB_CONFIG": str(config)},
                           stdin=subprocess.DEVNULL, capture_output=True, check=False)
            mods = (root / "mods").read_text().split()
            heavy = sorted({m.split(".")[0] for m in mods} & {"typer", "rich", "pydantic", "jsonschema", "stevedore", "yaml"})
            print(f"{args[0]}: {len(mods)} modules loaded; heavy ones: {heavy or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

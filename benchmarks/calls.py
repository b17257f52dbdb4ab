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
from collections.abc import Callable
from pathlib import Path

from flexhub.admin.harness import Kubelet, go_json
from flexhub.admin.install import install

HEAVY = {"typer", "rich", "pydantic", "jsonschema", "stevedore", "yaml"}


def timed(func: Callable[[], object], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        func()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def report(name: str, samples: list[float]) -> None:
    samples.sort()
    p90 = samples[int(len(samples) * 0.9) - 1] if len(samples) >= 10 else max(samples)
    median = statistics.median(samples)
    print(f"{name:<40} median {median:7.1f} ms   p90 {p90:7.1f} ms   n={len(samples)}")


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
        unknown = str(root / "none")
        report("unmount (unknown dir)", timed(lambda: kubelet.call("unmount", unknown), runs))
        if os.geteuid() == 0:
            user = {"backend": "loopfile", "file": "bench.img", "size": "64Mi"}
            uid = kubelet.new_pod_uid()
            opts = Kubelet.mount_options(user, pv="pv", pod_uid=uid)
            report(
                "mount (create+mkfs ext4, first)", timed(lambda: kubelet.mount(uid, "pv", opts), 1)
            )
            report("unmount (last user, detach)", timed(lambda: kubelet.unmount(uid, "pv"), 1))
            mounts: list[float] = []
            unmounts: list[float] = []
            for _ in range(max(3, runs // 3)):
                pod = kubelet.new_pod_uid()
                pod_opts = Kubelet.mount_options(user, pv="pv", pod_uid=pod)
                mounts += timed(lambda p=pod, o=pod_opts: kubelet.mount(p, "pv", o), 1)  # type: ignore[misc]
                unmounts += timed(lambda p=pod: kubelet.unmount(p, "pv"), 1)  # type: ignore[misc]
            report("mount (existing fs: attach+fsck+mount)", mounts)
            report("unmount (last user: detach)", unmounts)
        for args in (["init"], ["unmount", str(root / "none")]):
            code = (
                "import sys\nfrom flexhub.__main__ import main\n"
                f"main({args!r})\n"
                f"open({str(root / 'mods')!r}, 'w').write('\\n'.join(sys.modules))\n"
            )
            subprocess.run(
                [sys.executable, "-I", "-c", code],
                env={"FLEXHUB_CONFIG": str(config)},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
            )
            mods = (root / "mods").read_text().split()
            heavy = sorted({m.split(".")[0] for m in mods} & HEAVY)
            print(f"{args[0]}: {len(mods)} modules loaded; heavy ones: {heavy or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

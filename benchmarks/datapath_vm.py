"""The data-path benchmark in the VM rig: NFS and iSCSI volumes through flexhub, as ratios
against the guest's own block device. EMULATED figures only (qemu TCG, one vCPU, loopback
network): they compare the protocols' overheads with each other inside that guest and say
nothing about real hardware.

Run as root from a checkout where the VM rig works (``.ci/install-rig.sh``) and ``fio`` is
installed on the host (``.ci/install-system.sh``; the guest runs the host's binary, which it
sees over 9p)::

    python3 benchmarks/datapath_vm.py [--repeat 1] [--size 256MiB] [--runtime 3] [--ramp 1]

It boots a guest (``tests/rig/vm.py``, 1 GiB of RAM) and runs ``benchmarks/datapath.py``'s
fio jobs inside it on three targets:

``guest-disk``
    the reference: an ext4 (made with flexhub's own ``mkfs`` line) on a loop device whose file
    lives on a tmpfs of the guest. The guest has no disk image, and a tmpfs is not a block
    device; a loop device is one, backed by RAM like everything else of this guest. Its
    direct I/O is off: tmpfs of the rig's kernel has no ``O_DIRECT`` (so the loop device
    refuses it), and as the backing file is RAM there is no second page cache under it;
``nfs``
    that same filesystem, exported by the guest's kernel NFS server (``sync``) and mounted
    through the installed flexhub driver as kubelet mounts it (NFS 4.2 over 127.0.0.1);
``iscsi``
    a LUN of the guest's kernel LIO target, a fileio backstore on a file of a tmpfs (the
    same kind of storage: a file in the guest's RAM), mounted through the driver (login,
    ext4 made by flexhub on the blank LUN, mount over 127.0.0.1).

Before each job the guest writes back and drops its page cache (``sysctl vm.drop_caches=1``,
which also drops the NFS server's cache of the file). Each figure is the median over
``--repeat`` rounds with its spread and the median of the per-round ratios to ``guest-disk``;
the rounds alternate the targets' order. No goal is applied: these are not the figures of a
node.

``--smoke`` (the CI run, ``tests/vm/test_datapath_vm.py``, on the session's VM) runs every job
on every target once for a tenth of a second, all jobs of a target in one fio command (fio's
start-up under emulation costs 2-3 s; no cache is dropped between them), with an 8 MiB data
file. The benchmark leaves nothing mounted, exported, logged in or attached in the guest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the VM rig lives in the checkout's tests/
    sys.path.insert(1, str(REPO))

from datapath import (  # noqa: E402
    JOBS,
    Job,
    MiB,
    Results,
    batch_argv,
    fio_figure,
    prepare_argv,
    size_bytes,
)

from flexhub.admin.harness import Kubelet, ReplyError, go_json, parse_reply  # noqa: E402
from flexhub.node.fs import MKFS  # noqa: E402
from tests.rig import services  # noqa: E402
from tests.rig.vm import VM, RigError  # noqa: E402

ROOT = "/run/flexhub-bench-vm"
IMAGES = f"{ROOT}/images"  # a tmpfs of its own, sized for the disk's file
PLUGINS = f"{ROOT}/plugins"
CONFIG = f"{ROOT}/flexhub.toml"
DISK = f"{services.NFS_ROOT}/flexhub-bench"  # the disk's mount point, in the NFS pseudo-root
V4_PATH = "/flexhub-bench"  # that directory as an NFSv4 client names it
PODS = "/var/lib/kubelet/pods"
EXPORT_OPTIONS = "rw,sync,no_subtree_check,no_root_squash,insecure"
DATA = "fio.dat"
TARGETS = ("guest-disk", "nfs", "iscsi")
LABEL = " | emulated"
NFS_GRACE = "10"  # seconds of a fresh server's v4 grace period (the kernel's default is 90)


class BenchError(RuntimeError):
    """A step of the benchmark failed; the message is one line."""


def tail(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-3:])[-400:]


@dataclass
class GuestBench:
    """The three targets in one guest; ``vm`` is booted, its node set up."""

    vm: VM
    size: int
    runtime: str
    ramp: str
    selected: tuple[Job, ...] = JOBS
    batch: bool = False
    job_timeout: float = 300.0
    fstype: str = "ext4"
    driver: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def volume(self) -> int:
        """Bytes of each target's device: the data file, the journal, the metadata."""
        return self.size + max(self.size // 4, 64 * MiB)

    # -- the guest ---------------------------------------------------------------------------

    def run(self, argv: Sequence[str], timeout: float = 120.0) -> str:
        result = self.vm.run(list(argv), timeout=timeout, check=False)
        if result.rc != 0:
            what = "timed out" if result.timed_out else f"exited {result.rc}"
            raise BenchError(f"guest {argv[0]} {what}: {tail(result.output)}")
        return result.stdout

    def call(self, *argv: str) -> dict[str, object]:
        """One driver call exactly as kubelet makes it; its strictly parsed reply."""
        rc, output = self.vm.call_driver(self.driver, list(argv), timeout=300)
        try:
            reply = parse_reply(output.encode())
        except ReplyError as exc:
            raise BenchError(f"driver {argv[0]}: not a reply ({exc}): {tail(output)}") from None
        if rc != 0 or reply.get("status") != "Success":
            raise BenchError(f"driver {argv[0]} failed: {tail(str(reply.get('message', '')))}")
        return reply

    def setup(self) -> None:
        """The NFS server (first: its grace period runs out meanwhile), a tmpfs for the
        disk's file, the driver installed as on a node."""
        vm = self.vm
        self.run(["modprobe", "nfsd"])
        if vm.run(["mountpoint", "-q", "/proc/fs/nfsd"], check=False).rc != 0:
            self.run(["mount", "-t", "nfsd", "nfsd", "/proc/fs/nfsd"])
        if vm.read_file("/proc/fs/nfsd/threads").strip() == b"0":
            for name in ("nfsv4gracetime", "nfsv4leasetime"):
                vm.run(["tee", f"/proc/fs/nfsd/{name}"], input=f"{NFS_GRACE}\n")
        services.start_nfs_server(vm)
        self.run(["mkdir", "-p", "-m", "0700", IMAGES])
        if vm.run(["mountpoint", "-q", IMAGES], check=False).rc != 0:
            size = f"size={self.volume + 16 * MiB},mode=0700"
            self.run(["mount", "-t", "tmpfs", "-o", size, "flexhub-bench", IMAGES])
        vm.write_file(CONFIG, f'state_dir = "{ROOT}/state"\nlog_dir = "{ROOT}/log"\n')
        self.driver = vm.install_flexhub(PLUGINS, config=CONFIG)

    def teardown(self) -> None:
        """Remove what :meth:`setup` made (the NFS server keeps running: the rig's)."""
        self.vm.run(["umount", IMAGES], check=False)
        self.vm.run(["rm", "-rf", "--one-file-system", ROOT], check=False)

    # -- the targets -------------------------------------------------------------------------

    @contextlib.contextmanager
    def guest_disk(self) -> Iterator[str]:
        """The reference filesystem, mounted at :data:`DISK`; gone afterwards."""
        image = f"{IMAGES}/disk.img"
        self.run(["truncate", "-s", str(self.volume), image])
        try:
            device = self.run(["losetup", "--find", "--show", image]).strip()
            try:
                self.run([*MKFS[self.fstype], device])
                self.run(["mkdir", "-p", DISK])
                self.run(["mount", "-t", self.fstype, device, DISK])
                try:
                    if not any(note.startswith("# guest-disk:") for note in self.notes):
                        dio = self.vm.read_file(f"/sys/block/{device[5:]}/loop/dio").decode()
                        self.note("guest-disk", DISK, f"on a loop device (dio={dio.strip()})")
                    yield DISK
                finally:
                    self.unmount_disk()
            finally:
                self.vm.run(["losetup", "-d", device], check=False)
        finally:
            self.vm.run(["rm", "-f", image], check=False)

    def unmount_disk(self) -> None:
        # nfsd's file cache may hold the exported files for a moment after the unexport
        for _ in range(20):
            if self.vm.run(["umount", DISK], check=False).rc == 0:
                return
            time.sleep(0.5)
        self.run(["umount", DISK])

    @contextlib.contextmanager
    def exported(self, directory: str) -> Iterator[None]:
        client = f"127.0.0.0/8:{directory}"
        self.run(["exportfs", "-o", EXPORT_OPTIONS, client])
        try:
            yield
        finally:
            self.vm.run(["exportfs", "-u", client], check=False)

    @contextlib.contextmanager
    def mounted(self, pv: str, user: dict[str, str], fs_type: str = "") -> Iterator[str]:
        """A pod's volume mounted through the driver (kubelet's steps); unmounted after."""
        uid = Kubelet.new_pod_uid()
        pod = f"{PODS}/{uid}"
        target = f"{pod}/volumes/k8s~flexhub/{pv}"
        self.run(["mkdir", "-p", "-m", "0750", target])
        try:
            options = Kubelet.mount_options(user, pv=pv, pod_uid=uid, fs_type=fs_type)
            self.call("mount", target, go_json(options))
            try:
                yield target
            finally:
                self.call("unmount", target)
        finally:
            parts = [target, target.rsplit("/", 1)[0], f"{pod}/volumes", pod]
            self.vm.run(["rmdir", *parts], check=False)

    def note(self, name: str, directory: str, extra: str = "") -> None:
        source = fstype = options = "?"
        for line in self.vm.read_file("/proc/mounts").decode().splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[1] == directory:
                source, fstype, options = fields[0], fields[2], fields[3]
        self.notes.append(f"# {name}: {fstype} {source} ({options}) {extra}".rstrip())

    def jobs(self, directory: str, target: str, results: Results) -> None:
        data = f"{directory}/{DATA}"
        if self.batch:  # fio lays the file out itself
            output = self.run(batch_argv(self.selected, data, self.size, self.runtime, self.ramp))
            for index, job in enumerate(self.selected):
                results.add(job.name, target, fio_figure(job, output, index))
            return
        stat = self.vm.run(["stat", "-c", "%s", data], check=False)
        if stat.rc != 0 or stat.stdout.strip() != str(self.size):
            self.run(prepare_argv(data, self.size), self.job_timeout)
        for job in self.selected:
            self.run(["sync"])
            self.run(["sysctl", "-q", "vm.drop_caches=1"])
            output = self.run(job.argv(data, self.size, self.runtime, self.ramp), self.job_timeout)
            results.add(job.name, target, fio_figure(job, output))

    def disk_and_nfs(self, order: list[str], results: Results) -> None:
        with self.guest_disk() as directory:
            for target in order:
                if target == "guest-disk":
                    self.jobs(directory, target, results)
                    continue
                user = {"backend": "nfs", "server": "127.0.0.1", "share": V4_PATH}
                with self.exported(directory), self.mounted("pv-bench-nfs", user) as pod:
                    if not any(note.startswith("# nfs:") for note in self.notes):
                        self.note("nfs", pod)
                    self.jobs(pod, target, results)

    def iscsi(self, results: Results) -> None:
        lun = services.iscsi_target(self.vm, lun_sizes=[self.volume])
        try:
            user = {"backend": "iscsi", "targetPortal": lun.portal, "iqn": lun.iqn, "lun": "0"}
            with self.mounted("pv-bench-iscsi", user, fs_type=self.fstype) as pod:
                if not any(note.startswith("# iscsi:") for note in self.notes):
                    self.note("iscsi", pod, "LIO fileio on a tmpfs file")
                self.jobs(pod, "iscsi", results)
        finally:
            services.delete_iscsi_target(self.vm, lun)

    def rounds(self, repeat: int) -> Results:
        """``repeat`` rounds over the three targets; the disk's file and the LUN's file are
        never in the guest's RAM at once."""
        results = Results(list(TARGETS), reference="guest-disk", goal_target=None, label=LABEL)
        for number in range(repeat):
            started = time.monotonic()
            pair = ["guest-disk", "nfs"] if number % 2 == 0 else ["nfs", "guest-disk"]
            if number % 4 < 2:
                self.disk_and_nfs(pair, results)
                self.iscsi(results)
                order = [*pair, "iscsi"]
            else:
                self.iscsi(results)
                self.disk_and_nfs(pair, results)
                order = ["iscsi", *pair]
            print(
                f"# round {number + 1}/{repeat} ({' '.join(order)}): "
                f"{time.monotonic() - started:.0f}s",
                flush=True,
            )
        return results


def header(vm: VM, bench: GuestBench, repeat: int) -> str:
    fio = bench.run(["fio", "--version"]).strip()
    kernel = bench.run(["uname", "-r"]).strip()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return (
        f"# flexhub data-path benchmark in the VM rig, EMULATED (qemu TCG, {vm.smp} vCPU, "
        f"{vm.memory_mb} MiB, loopback network), {time.strftime('%Y-%m-%d %H:%M')}, host load "
        f"average {load} on {os.cpu_count()} cpus; guest {kernel}, {fio}; {bench.fstype} "
        f"volumes; data file {bench.size // MiB} MiB, {bench.runtime} (+{bench.ramp} ramp) "
        f"per job, medians of {repeat} round(s)"
    )


def benchmark(
    vm: VM,
    *,
    repeat: int = 1,
    size: int = 256 * MiB,
    runtime: float = 3.0,
    ramp: float = 1.0,
    jobs: Sequence[str] = (),
    smoke: bool = False,
) -> list[str]:
    """Run the benchmark in ``vm`` (booted, node set up); the lines it prints."""
    if smoke:
        repeat, size, runtime, ramp = 1, 8 * MiB, 0.1, 0.0
    bench = GuestBench(
        vm,
        size,
        f"{int(runtime * 1000)}ms",
        f"{int(ramp * 1000)}ms",
        tuple(job for job in JOBS if not jobs or job.name in jobs),
        batch=smoke,
        job_timeout=runtime + ramp + 240.0,
    )
    lines = [header(vm, bench, repeat)]
    print(lines[0], flush=True)
    bench.setup()
    try:
        results = bench.rounds(repeat)
    finally:
        bench.teardown()
    lines += [*bench.notes, *results.lines()]
    lines.append(
        "# ratios are to guest-disk in the same guest; emulated: the guest's CPU is emulated "
        "and its network is loopback, so they show the relative overheads of NFS and iSCSI "
        "there, not what a node gets"
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="rounds over every target")
    parser.add_argument("--size", type=size_bytes, default=256 * MiB, help="fio data file")
    parser.add_argument("--runtime", type=float, default=3.0, help="seconds per job")
    parser.add_argument("--ramp", type=float, default=1.0, help="unmeasured seconds per job")
    parser.add_argument(
        "--job",
        action="append",
        choices=[job.name for job in JOBS],
        help="run only this job (repeatable; default: all)",
    )
    parser.add_argument("--smoke", action="store_true", help="a short run, for CI")
    args = parser.parse_args()
    if args.repeat < 1 or args.runtime < 0.01 or args.ramp < 0 or args.size < MiB:
        parser.error("want --repeat >= 1, --runtime >= 0.01, --ramp >= 0, --size >= 1MiB")
    if args.size > 320 * MiB:
        parser.error("the guest has 1 GiB of RAM, which holds the files: want --size <= 320MiB")
    if os.geteuid() != 0:
        print("benchmark: needs root (the VM rig)", file=sys.stderr)
        return 2
    if shutil.which("fio") is None:
        print("benchmark: fio is not installed (.ci/install-system.sh)", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C: the VM is closed (qemu also dies with this process)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with VM() as vm:
            services.setup_node(vm)
            lines = benchmark(
                vm,
                repeat=args.repeat,
                size=args.size,
                runtime=args.runtime,
                ramp=args.ramp,
                jobs=args.job or (),
                smoke=args.smoke,
            )
    except (BenchError, RigError) as exc:
        print(f"benchmark: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    for line in lines[1:]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

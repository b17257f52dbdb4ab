"""The VM rig's boot files: the newest kernel in /boot with the modules the rig needs, the
busybox initramfs that mounts the host's ``/`` over virtio-9p (``init.sh``), and an
uncompressed kernel image for a faster boot; each built once into :data:`CACHE_ROOT`."""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import subprocess
import zlib
from pathlib import Path

RIG_DIR = Path(__file__).resolve().parent
CACHE_ROOT = Path(os.environ.get("FLEXHUB_RIG_CACHE", "/var/tmp/flexhub-rig"))
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")


def _version_key(ver: str) -> list[tuple[int, object]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"[.\-+~]", ver)]


def find_kernel() -> str | None:
    """Newest /boot/vmlinuz-<ver> that has modules with 9p and overlay."""
    found = []
    for vmlinuz in Path("/boot").glob("vmlinuz-*"):
        ver = vmlinuz.name.removeprefix("vmlinuz-")
        moddir = Path("/lib/modules") / ver
        if (moddir / "modules.dep").exists() and any(moddir.rglob("9pnet_virtio.ko*")):
            found.append(ver)
    return max(found, key=_version_key) if found else None


# --------------------------------------------------------------------------
# initramfs


class _Cpio:
    """Minimal newc cpio writer."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(
        self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
    ) -> None:
        nameb = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nameb), 0]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % f for f in fields) + nameb)
        self.buf.write(b"\0" * (-(110 + len(nameb)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _module_files(kver: str) -> list[Path]:
    """Module files (dependencies first) for the initramfs modules."""
    files: list[Path] = []
    for mod in INITRAMFS_MODULES:
        out = subprocess.run(
            ["modprobe", "-S", kver, "--show-depends", mod],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod":
                path = Path(parts[1])
                if path not in files:
                    files.append(path)
    return files


def build_initramfs(kver: str) -> Path:
    """Build (or reuse from the cache) the initramfs for kernel ``kver``."""
    busybox = next(p for p in BUSYBOX_CANDIDATES if os.path.exists(p))
    init = (RIG_DIR / "init.sh").read_bytes()
    mods = _module_files(kver)
    key = hashlib.sha256(init)
    for item in [Path(busybox), *mods]:
        st = item.stat()
        key.update(f"{item}:{st.st_size}:{st.st_mtime_ns}".encode())
    out_dir = CACHE_ROOT / kver / key.hexdigest()[:16]
    image = out_dir / "initramfs.cpio.gz"
    if image.exists():
        return image
    cpio = _Cpio()
    for d in ("bin", "dev", "mods", "proc", "sys"):
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    cpio.chardev("dev/null", 1, 3)
    cpio.file("bin/busybox", Path(busybox).read_bytes(), 0o755)
    cpio.file("init", init, 0o755)
    order = []
    for i, path in enumerate(mods):
        data = path.read_bytes()
        name = path.name
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name[:-3]
        elif name.endswith(".zst"):
            data = subprocess.run(
                ["zstd", "-dc", str(path)], check=True, capture_output=True
            ).stdout
            name = name[:-4]
        name = f"{i:02d}-{name}"
        cpio.file(f"mods/{name}", data)
        order.append(name)
    cpio.file("mods/order", ("\n".join(order) + "\n").encode())
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = image.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(gzip.compress(cpio.finish(), compresslevel=6))
    tmp.rename(image)
    return image


def kernel_image(kver: str) -> Path:
    """An uncompressed ELF vmlinux for ``kver`` if the kernel supports PVH
    boot (qemu then skips firmware and in-guest decompression, about 4 s under
    TCG), else the bzImage itself."""
    bzimage = Path(f"/boot/vmlinuz-{kver}")
    try:
        config = Path(f"/boot/config-{kver}").read_text()
    except OSError:
        return bzimage
    if "CONFIG_PVH=y" not in config:
        return bzimage
    st = bzimage.stat()
    out = CACHE_ROOT / kver / f"vmlinux-{st.st_size}-{st.st_mtime_ns}"
    if out.exists():
        return out
    data = bzimage.read_bytes()
    elf = b""
    off = data.find(b"\xfd7zXZ\x00")
    if off >= 0:
        elf = lzma.LZMADecompressor().decompress(data[off:])
    else:
        off = data.find(b"\x28\xb5\x2f\xfd")
        if off >= 0 and shutil.which("zstd"):
            elf = subprocess.run(["zstd", "-dc"], input=data[off:], capture_output=True).stdout
        else:
            off = data.find(b"\x1f\x8b\x08")
            if off >= 0:
                elf = zlib.decompressobj(31).decompress(data[off:])
    if not elf.startswith(b"\x7fELF"):
        return bzimage
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(elf)
    tmp.rename(out)
    return out

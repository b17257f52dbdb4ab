"""Replay kubelet's FlexVolume calls against an installed driver, as kubelet makes them.

Used by ``flexhub demo`` and by the tests. What it reproduces (kubelet's FlexVolume code):

* the driver runs with an argv list (no shell), stdin ``/dev/null``, stderr merged into
  stdout, a bare environment and cwd ``/``; the reply is parsed strictly as one JSON object;
* the options JSON is encoded like Go's ``json.Marshal`` of a ``map[string]string``;
* kubelet's own steps around ``mount``/``unmount``: create the pod directory 0750, skip
  ``mount`` when it is already a mount point, ``rmdir`` it after a successful ``unmount`` and
  after a failed ``mount``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DriverReply", "Kubelet", "go_json", "parse_reply"]

KUBELET_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_GO_ESCAPES = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


def go_json(options: Mapping[str, str]) -> str:
    """Encode ``options`` byte for byte as Go's ``json.Marshal(map[string]string)`` does."""
    text = json.dumps(dict(options), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for raw, escaped in _GO_ESCAPES.items():
        text = text.replace(raw, escaped)
    return text


class ReplyError(ValueError):
    """The driver's output is not exactly one JSON object (kubelet would fail to parse it)."""


def parse_reply(output: bytes) -> dict[str, Any]:
    """Parse merged driver output strictly: one JSON object, trailing whitespace allowed."""
    try:
        text = output.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReplyError(f"output is not UTF-8: {output[:200]!r}") from exc

    def reject(constant: str) -> None:
        raise ReplyError(f"non-standard JSON constant {constant}")

    decoder = json.JSONDecoder(parse_constant=reject)
    try:
        value, end = decoder.raw_decode(text)
    except ValueError as exc:
        raise ReplyError(f"output is not JSON ({exc}): {text[:300]!r}") from exc
    if text[end:].strip():
        raise ReplyError(f"extra output after the JSON reply: {text[end:][:300]!r}")
    if not isinstance(value, dict):
        raise ReplyError(f"reply is not a JSON object: {text[:300]!r}")
    if not isinstance(value.get("status"), str):
        raise ReplyError(f"reply has no status string: {text[:300]!r}")
    for key in ("attached",):
        if key in value and not isinstance(value[key], bool):
            raise ReplyError(f"{key} must be a JSON boolean")
    caps = value.get("capabilities")
    if caps is not None and not (
        isinstance(caps, dict) and all(isinstance(v, bool) for v in caps.values())
    ):
        raise ReplyError("capabilities must be an object of booleans")
    return value


@dataclass
class DriverReply:
    """One call and what came back."""

    argv: list[str]
    returncode: int
    output: bytes
    reply: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.reply.get("status", ""))

    @property
    def message(self) -> str:
        return str(self.reply.get("message", ""))

    @property
    def ok(self) -> bool:
        return self.status == "Success" and self.returncode == 0


@dataclass
class Kubelet:
    """A minimal kubelet for one FlexVolume driver.

    :param driver: the installed driver executable, ``<plugin-dir>/k8s~flexhub/flexhub``.
    :param root: kubelet's root directory (``/var/lib/kubelet`` on a node).
    """

    driver: Path
    root: Path
    env: Mapping[str, str] = field(default_factory=lambda: dict(KUBELET_ENV))
    timeout: float = 600.0

    @property
    def driver_dir_name(self) -> str:
        return self.driver.parent.name  # k8s~flexhub

    def call(self, *args: str) -> DriverReply:
        """Run the driver once, exactly as kubelet's ``DriverCall.Run`` does."""
        argv = [str(self.driver), *args]
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(self.env),
            cwd="/",
            timeout=self.timeout,
            check=False,
        )
        return DriverReply(argv, proc.returncode, proc.stdout, parse_reply(proc.stdout))

    # --- kubelet's option building ---------------------------------------------------

    @staticmethod
    def base_options(
        user: Mapping[str, str], *, pv: str, fs_type: str = "", read_only: bool = False
    ) -> dict[str, str]:
        options = {
            "kubernetes.io/fsType": fs_type,
            "kubernetes.io/readwrite": "ro" if read_only else "rw",
            "kubernetes.io/pvOrVolumeName": pv,
        }
        options.update(user)
        return options

    @staticmethod
    def mount_options(
        user: Mapping[str, str],
        *,
        pv: str,
        pod_uid: str,
        pod_name: str = "pod",
        namespace: str = "default",
        fs_type: str = "",
        read_only: bool = False,
        fs_group: int | None = None,
        secrets: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        options = {
            "kubernetes.io/fsType": fs_type,
            "kubernetes.io/readwrite": "ro" if read_only else "rw",
            "kubernetes.io/pvOrVolumeName": pv,
            "kubernetes.io/pod.name": pod_name,
            "kubernetes.io/pod.namespace": namespace,
            "kubernetes.io/pod.uid": pod_uid,
            "kubernetes.io/serviceAccount.name": "default",
        }
        for key, value in (secrets or {}).items():
            options[f"kubernetes.io/secret/{key}"] = base64.b64encode(value.encode()).decode()
        if fs_group is not None:
            options["kubernetes.io/mounterArgs.FsGroup"] = str(fs_group)
        options.update(user)
        return options

    # --- kubelet's steps around the calls ----------------------------------------------

    def pod_dir(self, pod_uid: str, pv: str) -> Path:
        return self.root / "pods" / pod_uid / "volumes" / self.driver_dir_name / pv

    @staticmethod
    def new_pod_uid() -> str:
        return str(uuid.uuid4())

    def init(self) -> DriverReply:
        return self.call("init")

    def mount(self, pod_uid: str, pv: str, options: Mapping[str, str]) -> DriverReply | None:
        """kubelet's SetUpAt: mkdir 0750, skip if mounted, call, rmdir on failure."""
        target = self.pod_dir(pod_uid, pv)
        if target.is_dir() and os.path.ismount(target):
            return None
        target.mkdir(mode=0o750, parents=True, exist_ok=True)
        reply = self.call("mount", str(target), go_json(options))
        if not reply.ok:
            with contextlib.suppress(OSError):
                target.rmdir()
        return reply

    def unmount(self, pod_uid: str, pv: str) -> DriverReply | None:
        """kubelet's TearDownAt: skip if the directory is gone, call, then rmdir."""
        target = self.pod_dir(pod_uid, pv)
        if not target.exists():
            return None
        reply = self.call("unmount", str(target))
        if reply.ok and target.exists():
            target.rmdir()  # os.Remove: fails (and kubelet retries) if not empty
        return reply

    def expandfs(
        self, pod_uid: str, pv: str, options: Mapping[str, str], new_size: int, old_size: int
    ) -> DriverReply:
        target = self.pod_dir(pod_uid, pv)
        return self.call(
            "expandfs", go_json(options), "", str(target), str(new_size), str(old_size)
        )

"""One kit run's node: a driver installed in its own plugin directory with its own config,
state, log and kubelet directories on a :class:`~flexhub.testing.host.Host`, and kubelet's
calls replayed against it (as :mod:`flexhub.admin.harness` does, through the host).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flexhub.admin.harness import KUBELET_ENV, Kubelet, ReplyError, go_json, parse_reply
from flexhub.node.volumes import CRASH_ENV, TRACE_ENV
from flexhub.testing.host import Host

__all__ = ["Call", "KitEnv", "KitFailure", "fail_line"]

PV = "pv-kit"
#: What a driver call costs besides its own work (interpreter start-up), by default.
DEFAULT_OVERHEAD = 10.0


class KitFailure(AssertionError):
    """One failed check, as its one line ``flexhub-kit <check>: <what>; <fix>``."""


def fail_line(check: str, what: str, fix: str) -> str:
    return f"flexhub-kit {check}: {what}; {fix}"


@dataclass
class Call:
    """One driver call: its argv, exit status, raw output, parsed reply (``None`` when the
    output is not exactly one JSON object), wall time, and whether it was killed."""

    argv: list[str]
    rc: int
    output: bytes
    reply: dict[str, Any] | None
    seconds: float
    timed_out: bool = False
    parse_error: str = ""

    @property
    def status(self) -> str:
        return str((self.reply or {}).get("status", ""))

    @property
    def message(self) -> str:
        return str((self.reply or {}).get("message", ""))

    @property
    def ok(self) -> bool:
        return self.status == "Success" and self.rc == 0

    @property
    def killed(self) -> bool:
        """Ended by SIGKILL with no reply (the shim execs python, or waits for it)."""
        return self.rc in (-9, 128 + 9) and not self.output.strip()

    def describe(self) -> str:
        if self.timed_out:
            return f"no reply within {self.seconds:.0f}s"
        if self.reply is None:
            return f"exit {self.rc}, output not one JSON object ({self.parse_error})"
        shown = json.dumps(self.reply, separators=(",", ":"))
        return f"exit {self.rc}, {shown[:300]}"


@dataclass
class KitEnv:
    """The installed driver and the directories of one kit run (see the module)."""

    host: Host
    base: str
    backend: str
    settings: Mapping[str, Any]
    python: str | None = None
    call_timeout: float = 60.0
    overhead: float = DEFAULT_OVERHEAD
    #: More top-level settings of the node config (``unmount_timeout``, ...).
    node_settings: Mapping[str, Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    driver: str = ""
    #: Whole block devices (not loop) present when the run started.
    devices_at_start: set[str] = field(default_factory=set)
    #: The checkpoints a traced mount and unmount of the sample reached (the crash checks'
    #: steps), once a check has traced them.
    traced: dict[str, list[str]] | None = None

    @property
    def state_dir(self) -> str:
        return f"{self.base}/state"

    @property
    def log_dir(self) -> str:
        return f"{self.base}/log"

    @property
    def plugin_dir(self) -> str:
        return f"{self.base}/plugins"

    @property
    def kubelet_root(self) -> str:
        return f"{self.base}/kubelet"

    @property
    def config_path(self) -> str:
        return f"{self.base}/flexhub.toml"

    @property
    def bound(self) -> float:
        """The longest a call may take: the node's ``call_timeout`` plus start-up."""
        return self.call_timeout + self.overhead

    def config_text(self) -> str:
        lines = [
            f"state_dir = {json.dumps(self.state_dir)}",
            f"log_dir = {json.dumps(self.log_dir)}",
            'log_level = "debug"',
            "lock_timeout = 30",
            f"call_timeout = {self.call_timeout:g}",
        ]
        lines += [f"{key} = {_toml_value(value)}" for key, value in self.node_settings.items()]
        lines.append(f"[{self.backend}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in self.settings.items()]
        return "\n".join(lines) + "\n"

    def setup(self) -> None:
        self.host.write_file(self.config_path, self.config_text().encode(), 0o644)
        self.driver = self.host.install_driver(self.plugin_dir, self.config_path, self.python)

    # -- calls ----------------------------------------------------------------------------

    def call(
        self,
        *args: str,
        crash_at: str | None = None,
        trace: str | None = None,
        timeout: float | None = None,
    ) -> Call:
        """Run the installed driver exactly as kubelet does (argv, bare env, cwd ``/``);
        ``crash_at``: the checkpoint to SIGKILL it at; ``trace``: the file it appends each
        checkpoint it reaches to."""
        env = dict(KUBELET_ENV)
        if crash_at:
            env[CRASH_ENV] = crash_at
        if trace:
            env[TRACE_ENV] = trace
        argv = [self.driver, *args]
        # the kit waits a little longer than the bound, so that a slow call is measured
        result = self.host.run(argv, env=env, timeout=timeout or self.bound + 30)
        reply: dict[str, Any] | None = None
        error = ""
        try:
            reply = parse_reply(result.output)
        except ReplyError as exc:
            error = str(exc)
        call = Call(argv, result.rc, result.output, reply, result.seconds, result.timed_out, error)
        self.calls.append(call)
        return call

    def new_pod(self, pv: str = PV) -> str:
        """A new pod's volume directory, not yet created."""
        return f"{self.kubelet_root}/pods/{uuid.uuid4()}/volumes/k8s~flexhub/{pv}"

    def options(
        self,
        target: str,
        user: Mapping[str, str],
        secrets: Mapping[str, str],
        *,
        read_only: bool = False,
        fs_group: int | None = None,
    ) -> str:
        parts = target.split("/")
        return go_json(
            Kubelet.mount_options(
                {"backend": self.backend, **user},
                pv=parts[-1],
                pod_uid=parts[-4],
                read_only=read_only,
                fs_group=fs_group,
                secrets=secrets,
            )
        )

    def mount(
        self, target: str, options: str, crash_at: str | None = None, trace: str | None = None
    ) -> Call | None:
        """kubelet's SetUpAt: mkdir 0750, skip if mounted, call, rmdir after a failure."""
        if self.is_mounted(target):
            return None
        self.host.make_dirs(target, 0o750)
        call = self.call("mount", target, options, crash_at=crash_at, trace=trace)
        if not call.ok and not call.killed:
            self.host.remove_dir(target)
        return call

    def unmount(
        self, target: str, crash_at: str | None = None, trace: str | None = None
    ) -> Call | None:
        """kubelet's TearDownAt: skip if the directory is gone, call, rmdir after Success."""
        if not self.host.exists(target):
            return None
        call = self.call("unmount", target, crash_at=crash_at, trace=trace)
        if call.ok:
            self.host.remove_dir(target)
        return call

    # -- what is left on the node ---------------------------------------------------------

    def is_mounted(self, target: str) -> bool:
        return any(m.target == target for m in self.host.mounts())

    def mounts_left(self) -> list[str]:
        roots = (self.kubelet_root + "/", self.state_dir + "/")
        return [m.target for m in self.host.mounts() if m.target.startswith(roots)]

    def records_left(self) -> list[str]:
        dirs = [f"{self.state_dir}/pods", f"{self.state_dir}/volumes"]
        return [path for path in self.host.list_files(dirs) if path.endswith(".json")]

    def pod_dirs_left(self) -> list[str]:
        pods = f"{self.kubelet_root}/pods"
        listed = self.host.run(
            ["find", pods, "-mindepth", "4", "-maxdepth", "4"], env=KUBELET_ENV, timeout=30
        )
        return [p for p in listed.output.decode().split() if p.startswith(pods)]

    def files_written(self) -> list[str]:
        return self.host.list_files([self.state_dir, self.log_dir, self.plugin_dir])

    def cleanup(self) -> list[str]:
        """Unmount every pod directory still there (as kubelet would, again and again);
        return what is still mounted."""
        for _ in range(2):
            for target in self.pod_dirs_left():
                self.unmount(target)
        return self.mounts_left()

    def teardown(self) -> list[str]:
        """:meth:`cleanup`, then remove the run's directory unless something is still
        mounted under it; return what is still mounted."""
        left = self.cleanup()
        if not left:
            self.host.remove_tree(self.base)
        return left


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Iterable):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} into the node config")

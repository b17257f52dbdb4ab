"""The conformance checks: :class:`Conformance`, whose ``test_*`` methods pytest collects in a
backend package's subclass. Each check drives the installed driver the way kubelet calls it
(:class:`~flexhub.testing.env.KitEnv`) and fails with one line
``flexhub-kit <check>: <what is wrong>; <what to fix>``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from flexhub.admin.harness import KUBELET_ENV, Kubelet, go_json
from flexhub.testing.crash import CrashChecks
from flexhub.testing.devices import block_devices, default_attached, detach_loops
from flexhub.testing.env import Call, KitEnv, fail_line
from flexhub.testing.provisioning import ProvisioningChecks, ProvisionSample
from flexhub.testing.secretscan import scan


def lint_schema(schema: Mapping[str, Any]) -> list[str]:
    """:func:`flexhub.testing.lint.lint_schema`, imported when a check needs it (it loads
    jsonschema, which the plugin itself never needs)."""
    from flexhub.testing.lint import lint_schema as lint

    return lint(schema)


__all__ = [
    "Conformance",
    "ProvisionSample",
    "Sample",
    "block_devices",
    "default_attached",
    "detach_loops",
]

static = pytest.mark.flexhub_static
storage = pytest.mark.flexhub_storage

#: An option no backend schema accepts (``additionalProperties: false`` is required).
UNKNOWN_OPTION = "flexhubKitNoSuchOption"
DATA = b"written by the flexhub conformance kit\n"


@dataclass(frozen=True)
class Sample:
    """A volume that works on this machine: its ``flexVolume.options`` (strings, no
    ``backend`` key), its Secret's data in plain text, an optional ``fsGroup`` for one of the
    pods, and the size in bytes to grow it to (``None``: the backend cannot expandfs)."""

    options: Mapping[str, str]
    secrets: Mapping[str, str] = field(default_factory=dict)
    fs_group: int | None = None
    expand_to: int | None = None


def fail(check: str, what: str, fix: str) -> None:
    __tracebackhide__ = True
    pytest.fail(fail_line(check, what, fix), pytrace=False)


class Conformance(CrashChecks, ProvisioningChecks):
    """Subclass it, set :attr:`backend`, implement :meth:`sample` and :meth:`unreachable`;
    for a backend that mixes in Provisioning, :meth:`provision_sample` and :meth:`assets`
    too (:mod:`flexhub.testing.provisioning`).

    Optional: :meth:`settings` (the backend's table of the node config), :attr:`node_settings`
    (more top-level settings of it: ``unmount_timeout``, ...), :meth:`attached`
    (what the backend may leave attached on the node), :attr:`call_timeout` (the node's
    ``call_timeout`` in the kit's config), :attr:`overhead` (seconds a call may take beyond
    it: interpreter start-up), :attr:`mount_bound` and :attr:`unmount_bound` (the longest a
    mount and an unmount may take with the storage unreachable, from the step bounds of the
    node config: the sum of the timeouts of the steps the call can run into; ``None``:
    :attr:`call_timeout`), :attr:`recovery` (seconds a deferred release may take to
    finish once the storage is back; the node retries one ``release_retry_interval``, 30 s by
    default, after the deferral), :attr:`fs_group_mode` (the mode bits the volume's root must
    have in a pod with the sample's ``fs_group``) and :attr:`fs_overhead` (the share of
    ``expand_to`` the filesystem's own metadata may take). While a check runs, :attr:`env` is
    the run's :class:`~flexhub.testing.env.KitEnv` (its ``base`` directory, its ``host``).
    """

    backend: ClassVar[str] = ""
    call_timeout: ClassVar[float] = 60.0
    overhead: ClassVar[float] = 10.0
    mount_bound: ClassVar[float | None] = None
    unmount_bound: ClassVar[float | None] = None
    recovery: ClassVar[float] = 60.0
    node_settings: ClassVar[Mapping[str, Any]] = {}
    #: flexhub's block volumes: group rwx and setgid on the root (``g+rwxs``).
    fs_group_mode: ClassVar[int] = 0o2070
    #: xfs of 600 MiB keeps about 11% for its log and metadata reserves.
    fs_overhead: ClassVar[float] = 0.15
    #: Why the backend's calls never carry a secret ("": they can, and the sample's must):
    #: the only way a sample without secrets passes the secret scan (``secrets``).
    secrets_not_applicable: ClassVar[str] = ""

    #: The run's installed driver and directories, while a check runs.
    env: KitEnv

    _attached_before: frozenset[str] = frozenset()

    @pytest.fixture(autouse=True)
    def _flexhub_bind(self, request: pytest.FixtureRequest, flexhub_env: KitEnv) -> None:
        self.env = flexhub_env
        if request.node.get_closest_marker("flexhub_storage"):
            self._attached_before = frozenset(self.attached(flexhub_env))

    # -- what the backend author provides ---------------------------------------------------

    def sample(self) -> Sample:
        raise NotImplementedError("Conformance.sample() must return a Sample")

    @contextlib.contextmanager
    def unreachable(self, sample: Sample) -> Iterator[None]:
        """Make the sample's storage unreachable while inside (e.g. stop the server, drop
        its packets); the kit calls it only around calls it expects to fail or to be bounded."""
        raise NotImplementedError
        yield  # pragma: no cover

    def settings(self, base: str) -> Mapping[str, Any]:
        """The backend's table of the kit's node config; ``base`` is the run's private
        directory on the host (put any directory the backend needs under it)."""
        return {}

    def attached(self, env: KitEnv) -> list[str]:
        """What is still attached to the node for this run (loop devices backed by files
        under the run's directory, new block devices since the run started). Extend it when
        the backend attaches something else (a session, a map)."""
        return default_attached(env)

    # -- helpers ------------------------------------------------------------------------

    def _sample(self) -> Sample:
        sample = self.sample()
        if "backend" in sample.options:
            fail("sample", "Sample.options has a 'backend' key", "leave it out: the kit adds it")
        return sample

    def _options(
        self,
        env: KitEnv,
        target: str,
        sample: Sample,
        *,
        read_only: bool = False,
        fs_group: int | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> str:
        return env.options(
            target,
            {**sample.options, **(extra or {})},
            sample.secrets,
            read_only=read_only,
            fs_group=fs_group,
        )

    def _mount(self, env: KitEnv, check: str, target: str, sample: Sample, **kw: Any) -> Call:
        __tracebackhide__ = True
        call = env.mount(target, self._options(env, target, sample, **kw))
        if call is None:
            fail(check, f"{target} is already a mount point before its mount", "see above")
            raise AssertionError  # unreachable
        if not call.ok:
            fail(check, f"mount failed: {call.describe()}", "mount of the sample must succeed")
        if not env.is_mounted(target):
            fail(
                check,
                "mount replied Success but nothing is mounted on the pod directory",
                "mount onto the target directory kubelet passes",
            )
        return call

    def _unmount(self, env: KitEnv, check: str, target: str) -> None:
        __tracebackhide__ = True
        call = env.unmount(target)
        if call is not None and not call.ok:
            fail(check, f"unmount failed: {call.describe()}", "unmount must succeed")
        if env.is_mounted(target):
            fail(
                check,
                f"unmount replied Success but {target} is still mounted",
                "unmount the pod directory",
            )
        if env.host.exists(target):
            fail(
                check,
                "the pod directory could not be removed after unmount (not empty?)",
                "leave the pod directory empty and unmounted",
            )

    def _assert_clean(self, env: KitEnv, check: str, after: str) -> None:
        """Nothing mounted, recorded or left in kubelet's pods directory, and nothing attached
        that was not already attached when the check started (a check failed before)."""
        __tracebackhide__ = True
        left = []
        left += [f"mounted: {m}" for m in env.mounts_left()]
        left += [f"attached: {a}" for a in self.attached(env) if a not in self._attached_before]
        left += [f"recorded: {r}" for r in env.records_left()]
        left += [f"pod directory: {p}" for p in env.pod_dirs_left()]
        if left:
            env.cleanup()
            fail(
                check,
                f"after {after}, left behind: {', '.join(left)}",
                "unmount must undo everything mount did, including a half-done mount",
            )

    def _write(self, env: KitEnv, target: str, name: str) -> None:
        env.host.write_file(f"{target}/{name}", DATA, 0o644)

    def _read(self, env: KitEnv, target: str, name: str) -> bytes | None:
        return env.host.read_file(f"{target}/{name}")

    # -- checks that need no storage ----------------------------------------------------

    @static
    def test_schema_lint(self) -> None:
        """The backend's option schema passes :func:`flexhub.testing.lint.lint_schema`."""
        from flexhub.driver.loader import load_backend

        problems = lint_schema(load_backend(self.backend).schema())
        if problems:
            fail("schema-lint", "; ".join(problems), "fix the backend's schema.json")

    @static
    def test_sample_options_validate(self) -> None:
        """The sample's options validate against the backend's schema and checks."""
        from flexhub.driver.loader import load_backend
        from flexhub.driver.validation import validate_options
        from flexhub.errors import FlexhubError
        from flexhub.volume import Volume

        sample = self._sample()
        cls = load_backend(self.backend)
        options = Kubelet.base_options({"backend": self.backend, **sample.options}, pv="pv-kit")
        try:
            validate_options(cls, options)
            cls.check_options(Volume.from_options(options))
        except FlexhubError as exc:
            fail(
                "sample-options",
                f"the sample's options are refused: {exc}",
                "give Sample.options that the schema and check_options() accept",
            )

    @static
    def test_init(self, flexhub_env: KitEnv) -> None:
        """``init`` replies Success with ``attach: false`` in one JSON object."""
        call = flexhub_env.call("init")
        if not call.ok or (call.reply or {}).get("capabilities", {}).get("attach") is not False:
            fail(
                "init",
                f"init replied {call.describe()}",
                "init must succeed with capabilities.attach false",
            )

    @static
    def test_unmount_missing_dir(self, flexhub_env: KitEnv) -> None:
        """``unmount`` of a directory that does not exist is Success (kubelet retries a
        Failure for ever)."""
        target = flexhub_env.new_pod()
        call = flexhub_env.call("unmount", target)
        if not call.ok:
            fail(
                "unmount-missing",
                f"unmount of a missing directory: {call.describe()}",
                "unmount of a directory that does not exist must reply Success",
            )

    @static
    def test_unmount_never_mounted(self, flexhub_env: KitEnv) -> None:
        """``unmount`` of an empty directory nothing was ever mounted on is Success and
        leaves it for kubelet to remove."""
        env = flexhub_env
        target = env.new_pod()
        env.host.make_dirs(target)
        call = env.call("unmount", target)
        if not call.ok:
            env.host.remove_dir(target)
            fail(
                "unmount-never-mounted",
                f"unmount of a never-mounted directory: {call.describe()}",
                "unmount of an unmounted directory must reply Success",
            )
        if not env.host.remove_dir(target):
            fail(
                "unmount-never-mounted",
                "the directory is not empty after unmount",
                "leave an unmounted directory empty",
            )

    @static
    def test_bad_options(self, flexhub_env: KitEnv) -> None:
        """A mount with an option the schema does not know fails with one line naming it and
        changes nothing."""
        env = flexhub_env
        sample = self._sample()
        target = env.new_pod()
        since = len(env.calls)
        call = env.mount(target, self._options(env, target, sample, extra={UNKNOWN_OPTION: "x"}))
        assert call is not None
        if call.ok or call.status != "Failure" or call.rc != 1:
            env.cleanup()
            fail(
                "bad-options",
                f"an unknown option was accepted: {call.describe()}",
                "set additionalProperties: false in the schema",
            )
        if "\n" in call.message.strip() or UNKNOWN_OPTION not in call.message:
            fail(
                "bad-options",
                f"the Failure does not name {UNKNOWN_OPTION} in one line: {call.message[:200]!r}",
                "reply one line that names the bad option",
            )
        self._assert_clean(env, "bad-options", "a refused mount")
        self._no_secret_shown(env, "bad-options", sample, since)

    # -- checks that mount ----------------------------------------------------------------

    @storage
    def test_kubelet_sequence(self, flexhub_env: KitEnv) -> None:
        """Pod A mounts and writes; pod B mounts and reads it; a read-only pod C refuses
        writes; (an fsGroup pod D); unmount in a different order than mount; pod E remounts and
        finds the data; expandfs to ``expand_to`` grows E's filesystem; nothing left."""
        env, sample, check = flexhub_env, self._sample(), "sequence"
        since = len(env.calls)
        a, b, c = env.new_pod(), env.new_pod(), env.new_pod()
        self._mount(env, check, a, sample)
        self._write(env, a, "kit-a")
        self._mount(env, check, b, sample)
        if self._read(env, b, "kit-a") != DATA:
            fail(
                check,
                "pod B does not see what pod A wrote on the same volume",
                "mount the same storage for every pod of a PV",
            )
        self._mount(env, check, c, sample, read_only=True)
        touch = env.host.run(["touch", f"{c}/kit-ro"], env=KUBELET_ENV, timeout=60)
        flags = [m.options.split(",") for m in env.host.mounts() if m.target == c]
        if touch.rc == 0 or b"Read-only file system" not in touch.output or "ro" not in flags[-1]:
            fail(
                check,
                "a read-only pod (kubernetes.io/readwrite=ro) is not mounted ro"
                f" (options {','.join(flags[-1])}; touch: {touch.output[:100]!r})",
                "mount read-only when kubernetes.io/readwrite is ro",
            )
        pods = [b, c, a]
        if sample.fs_group is not None:
            d = env.new_pod()
            self._mount(env, check, d, sample, fs_group=sample.fs_group)
            self._check_fs_group(env, check, d, sample.fs_group)
            pods.insert(1, d)
        for target in pods:  # not the order of the mounts
            self._unmount(env, check, target)
        e = env.new_pod()
        self._mount(env, check, e, sample)
        if self._read(env, e, "kit-a") != DATA:
            fail(
                check,
                "after every pod unmounted, a new pod does not find the data",
                "keep the data of a volume across mounts",
            )
        if sample.expand_to is not None:
            self._expand(env, check, e, sample)
        self._unmount(env, check, e)
        self._assert_clean(env, check, "the sequence")
        self._no_secret_shown(env, check, sample, since)

    def _check_fs_group(self, env: KitEnv, check: str, target: str, group: int) -> None:
        __tracebackhide__ = True
        out = env.host.run(["stat", "-c", "%g %a", target], env=KUBELET_ENV, timeout=60)
        gid, mode = out.output.decode().split()
        want = self.fs_group_mode
        if int(gid) != group or int(mode, 8) & want != want:
            fail(
                check,
                f"in a pod with fsGroup {group}, the volume's root is group {gid}, mode {mode}"
                f" (want group {group}, mode bits {want:o})",
                "give the volume's root the pod's fsGroup (kubernetes.io/mounterArgs.FsGroup)",
            )

    def _expand(self, env: KitEnv, check: str, target: str, sample: Sample) -> None:
        __tracebackhide__ = True
        assert sample.expand_to is not None
        before = _fs_size(env, target)
        options = go_json(
            Kubelet.base_options({"backend": self.backend, **sample.options}, pv="pv-kit")
        )
        for attempt in ("expandfs", "a second identical expandfs"):
            call = env.call("expandfs", options, "", target, str(sample.expand_to), str(before))
            if not call.ok:
                fail(
                    check,
                    f"{attempt} failed: {call.describe()}",
                    "expandfs must grow the filesystem and be idempotent",
                )
        want = int(sample.expand_to * (1 - self.fs_overhead))
        if before >= want:
            fail(
                check,
                f"the filesystem is already {before} bytes before expandfs to {sample.expand_to}",
                "give Sample.expand_to well above the volume's size",
            )
        after = _fs_size(env, target)
        if after < want:
            fail(
                check,
                f"expandfs to {sample.expand_to} bytes replied Success but the filesystem is"
                f" {after} bytes (was {before}; at least {want} expected)",
                "grow the device and the filesystem to the requested size in expandfs",
            )

    @storage
    def test_idempotency(self, flexhub_env: KitEnv) -> None:
        """After a mount, a kubelet restart (``init`` again); a repeated mount of the same
        directory is Success and still one mount; a repeated unmount (before kubelet removes
        the directory; kubelet passes only the directory) is Success and leaves nothing."""
        env, sample, check = flexhub_env, self._sample(), "idempotent"
        since = len(env.calls)
        target = env.new_pod()
        self._mount(env, check, target, sample)
        if not env.call("init").ok:
            fail(check, "init failed after a mount (a kubelet restart)", "init must always succeed")
        again = env.call("mount", target, self._options(env, target, sample))
        if not again.ok:
            fail(
                check,
                f"a second mount of a mounted directory: {again.describe()}",
                "a mount of a directory already mounted with this volume must reply Success",
            )
        stacked = [m for m in env.host.mounts() if m.target == target]
        if len(stacked) != 1:
            fail(
                check,
                f"a second mount stacked {len(stacked)} mounts on the pod directory",
                "do nothing when the directory already holds this volume",
            )
        for attempt in ("unmount", "a second unmount"):
            call = env.call("unmount", target)
            if not call.ok:
                fail(check, f"{attempt}: {call.describe()}", "unmount must be idempotent")
        if not env.host.remove_dir(target):
            fail(
                check,
                "the pod directory is not empty or still mounted after unmount",
                "unmount must leave the directory empty",
            )
        self._assert_clean(env, check, "mount, init, mount, unmount, unmount")
        self._no_secret_shown(env, check, sample, since)

    @storage
    def test_bounded_when_unreachable(self, flexhub_env: KitEnv) -> None:
        """With the storage unreachable, the unmount of a volume mounted before succeeds and
        then a new mount (nothing of the volume left on the node) fails, each within the
        bound of its steps in the node config plus start-up (:attr:`unmount_bound`,
        :attr:`mount_bound`, :attr:`overhead`; :attr:`call_timeout` when not given).

        A block backend may keep its device while the storage is unreachable
        (``ReleaseDeferred``): once the storage is back, the node's next unmount calls must
        release it within :attr:`recovery` seconds (the kit calls ``unmount`` of a pod
        directory with nothing on it every two seconds, as a busy kubelet would)."""
        env, sample, check = flexhub_env, self._sample(), "bounded"
        since = len(env.calls)
        mounted, new = env.new_pod(), env.new_pod()
        self._mount(env, check, mounted, sample)
        try:
            context = self.unreachable(sample)
            context.__enter__()
        except NotImplementedError:
            env.cleanup()
            fail(
                check,
                "Conformance.unreachable() is not implemented",
                "implement it: make the sample's storage unreachable while inside",
            )
        try:
            unmount = env.unmount(mounted)
            mount = env.mount(new, self._options(env, new, sample))
        finally:
            context.__exit__(None, None, None)
        assert unmount is not None and mount is not None
        problems = []
        if not unmount.ok:
            problems.append(
                (
                    f"unmount failed: {unmount.describe()}",
                    "unmount must succeed without the storage (forced/lazy unmount)",
                )
            )
        unmount_bound = self._bound(self.unmount_bound)
        mount_bound = self._bound(self.mount_bound)
        if unmount.seconds > unmount_bound or unmount.timed_out:
            problems.append(
                (
                    f"unmount took {unmount.seconds:.1f}s (bound {unmount_bound:g}s)",
                    "bound every step of unmount",
                )
            )
        if mount.ok:
            problems.append(
                (
                    "mount succeeded with the storage unreachable",
                    "make unreachable() really cut the storage off",
                )
            )
        if mount.seconds > mount_bound or mount.timed_out:
            problems.append(
                (
                    f"mount took {mount.seconds:.1f}s (bound {mount_bound:g}s)",
                    "bound every step of mount (node.runner timeouts; no blocking "
                    "call that ignores signals)",
                )
            )
        if problems:
            env.cleanup()
            fail(check, "; ".join(p[0] for p in problems), "; ".join(p[1] for p in problems))
        env.cleanup()
        self._await_deferred_release(env)
        self._assert_clean(env, check, "the calls with the storage unreachable")
        self._no_secret_shown(env, check, sample, since)

    def _bound(self, steps: float | None) -> float:
        """The longest a call whose steps are bounded by ``steps`` seconds may take."""
        return min(self.call_timeout if steps is None else steps, self.call_timeout) + (
            self.overhead
        )

    def _await_deferred_release(self, env: KitEnv) -> None:
        """Call ``unmount`` of an empty pod directory until nothing of the check's volumes is
        left attached or recorded, for at most :attr:`recovery` seconds."""
        deadline = time.monotonic() + self.recovery
        while time.monotonic() < deadline:
            left = env.records_left() or [
                a for a in self.attached(env) if a not in self._attached_before
            ]
            if not left:
                return
            idle = env.new_pod()
            env.host.make_dirs(idle)
            env.unmount(idle)
            time.sleep(2)

    def _no_secret_shown(self, env: KitEnv, check: str, sample: Sample, since: int) -> None:
        """The kit's secret scan after ``check`` (:func:`~flexhub.testing.secretscan.scan`)."""
        __tracebackhide__ = True
        scan(env, check, sample.secrets, since, self.secrets_not_applicable)


def _fs_size(env: KitEnv, target: str) -> int:
    out = env.host.run(["stat", "-f", "-c", "%b %S", target], env=KUBELET_ENV, timeout=60)
    blocks, size = out.output.decode().split()
    return int(blocks) * int(size)

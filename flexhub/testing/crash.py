"""The kit's crash checks (``crash-mount``, ``crash-unmount``), a part of
:class:`~flexhub.testing.Conformance`: for each checkpoint a mount or an unmount of the sample
reaches (from one traced run), the call is SIGKILLed there and then retried the way kubelet
would; nothing may be left mounted, attached or recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from flexhub.admin.harness import KUBELET_ENV
from flexhub.testing.env import Call, KitEnv, fail_line

__all__ = ["CrashChecks"]

storage = pytest.mark.flexhub_storage


def fail(check: str, what: str, fix: str) -> None:
    __tracebackhide__ = True
    pytest.fail(fail_line(check, what, fix), pytrace=False)


class CrashChecks:
    """The crash checks; the helpers they use are :class:`~flexhub.testing.Conformance`'s."""

    if TYPE_CHECKING:  # given by Conformance, which mixes this in

        def _sample(self) -> Any: ...
        def _options(self, env: KitEnv, target: str, sample: Any) -> str: ...
        def _mount(self, env: KitEnv, check: str, target: str, sample: Any) -> Call: ...
        def _unmount(self, env: KitEnv, check: str, target: str) -> None: ...
        def _assert_clean(self, env: KitEnv, check: str, after: str) -> None: ...
        def _write(self, env: KitEnv, target: str, name: str) -> None: ...
        def _no_secret_shown(self, env: KitEnv, check: str, sample: Any, since: int) -> None: ...

    def _traced(self, env: KitEnv, sample: Any) -> dict[str, list[str]]:
        """The checkpoints (flexhub/node/volumes.py) a mount and an unmount of the sample
        reach, from one traced mount and unmount (once per run), after one untraced mount and
        unmount: the steps of every later mount (a block volume's first mount also formats
        it, at ``format-intent`` and ``formatted``, which no later mount reaches)."""
        __tracebackhide__ = True
        if env.traced is None:
            check = "crash-trace"
            first = env.new_pod()
            call = env.mount(first, self._options(env, first, sample))
            if call is None or not call.ok:
                env.cleanup()
                fail(check, f"the first mount failed: {call and call.describe()}", "see above")
            self._unmount(env, check, first)
            target = env.new_pod()
            files = {
                phase: f"{env.base}/trace-{phase}-{target.split('/')[-4]}"
                for phase in ("mount", "unmount")
            }
            call = env.mount(target, self._options(env, target, sample), trace=files["mount"])
            if call is None or not call.ok or not env.is_mounted(target):
                env.cleanup()
                fail(check, f"the traced mount failed: {call and call.describe()}", "see above")
            unmount = env.unmount(target, trace=files["unmount"])
            if unmount is None or not unmount.ok:
                env.cleanup()
                fail(check, f"the traced unmount failed: {unmount and unmount.describe()}", "")
            env.traced = {}
            for phase, path in files.items():
                text = (env.host.read_file(path) or b"").decode()
                env.host.run(["rm", "-f", "--", path], env=KUBELET_ENV, timeout=60)
                env.traced[phase] = list(dict.fromkeys(text.split()))
        for phase, points in env.traced.items():
            if not points:
                fail(
                    f"crash-{phase}",
                    f"a {phase} of the sample reached no checkpoint",
                    "the driver must run flexhub.node.volumes (FLEXHUB_TEST_TRACE unset?)",
                )
        return env.traced

    def _killed(self, check: str, point: str, call: Call | None) -> None:
        __tracebackhide__ = True
        if call is None or not call.killed:
            fail(
                check,
                f"the call was not killed at {point}: {call and call.describe()}",
                f"the driver must SIGKILL itself at checkpoint {point} (FLEXHUB_TEST_CRASH_AT)",
            )

    @storage
    def test_crash_during_mount(self, flexhub_env: KitEnv) -> None:
        """For each checkpoint a mount of the sample reaches (from a traced run): SIGKILL
        there (the mount must really be killed), the mount again (kubelet retries), a write,
        then unmount: nothing left mounted, attached or recorded."""
        env, sample = flexhub_env, self._sample()
        since = len(env.calls)
        for point in self._traced(env, sample)["mount"]:
            check = f"crash-mount[{point}]"
            target = env.new_pod()
            options = self._options(env, target, sample)
            self._killed(check, point, env.mount(target, options, crash_at=point))
            retry = env.call("mount", target, options)
            if not retry.ok:
                env.cleanup()
                fail(
                    check,
                    f"the retry after a SIGKILL at {point} failed: {retry.describe()}",
                    "a mount must finish (or redo) what a killed mount left",
                )
            self._write(env, target, "kit-crash")
            self._unmount(env, check, target)
            self._assert_clean(env, check, f"a SIGKILL at {point}, a retry and an unmount")
        self._no_secret_shown(env, "crash-mount", sample, since)

    @storage
    def test_crash_during_unmount(self, flexhub_env: KitEnv) -> None:
        """For each checkpoint an unmount of the sample reaches (from a traced run): SIGKILL
        there (the unmount must really be killed), then unmount again: nothing left."""
        env, sample = flexhub_env, self._sample()
        since = len(env.calls)
        for point in self._traced(env, sample)["unmount"]:
            check = f"crash-unmount[{point}]"
            target = env.new_pod()
            self._mount(env, check, target, sample)
            self._killed(check, point, env.call("unmount", target, crash_at=point))
            self._unmount(env, check, target)
            self._assert_clean(env, check, f"a SIGKILL at {point} and a retried unmount")
        self._no_secret_shown(env, "crash-unmount", sample, since)

"""Each check of the conformance kit (``flexhub.testing``) seen to fail: the kit runs (through
``pytester``, in a separate pytest) against a backend or driver broken in one way, and the
check names it in its one line; the same kit passes a backend that conforms.

The backends are in tests/fixtures/kitsite/flexhub_kitbackends; a broken driver is the real
one run through tests/fixtures/kitsite/kitflaws.py, which misbehaves on some calls.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import needs_root

pytestmark = [needs_root, pytest.mark.root]

KITSITE = Path(__file__).resolve().parents[1] / "fixtures" / "kitsite"

TEST_FILE = """
import contextlib
import pathlib

import pytest

from flexhub.testing import Conformance, ProvisionSample, Sample


@pytest.fixture(scope="class")
def flexhub_python():
    return {python!r}


class TestKit(Conformance):
    backend = {backend!r}
    call_timeout = 15  # (5 s, then 8 s, were past by a plain call on a loaded CI machine)
    overhead = 5
    recovery = 6
    node_settings = {{"release_retry_interval": 1}}
{extra}
    def settings(self, base):
        return {{"root": base + "/storage"}}

    def sample(self):
        return Sample(
            options={options!r}, secrets={secrets!r}, fs_group={fs_group!r}
        )

    def provision_sample(self):
        return ProvisionSample(secrets={{"token": "kit-Secret-Token-42"}})

    def assets(self, claim):
        storage = pathlib.Path(self.env.base, "storage")
        return [str(p) for p in storage.glob("pvc-" + claim.uid[:8] + "*")]

    @contextlib.contextmanager
    def unreachable(self, sample):
        flag = pathlib.Path(self.env.base, "storage", ".unreachable")
        flag.parent.mkdir(parents=True, exist_ok=True)
        flag.touch()
        try:
            yield
        finally:
            flag.unlink()
"""


def run_kit(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    *,
    flaw: str = "",
    select: str = "",
    options: dict[str, str] | None = None,
    fs_group: int | None = None,
    secrets: dict[str, str] | None = None,
    extra: str = "",
) -> pytest.RunResult:
    """Run the kit against ``backend`` (with the driver's ``flaw``), only the checks
    ``select`` (a ``-k`` expression) if given."""
    wrapper = pytester.path / "kit-python"
    wrapper.write_text(
        "#!/bin/sh\n"
        '[ "$1" = "-I" ] && shift\n'  # the shim's -I would ignore PYTHONPATH
        f"PYTHONPATH={KITSITE} FLEXHUB_KIT_FLAW={flaw} "
        f'exec {sys.executable} {KITSITE / "kitflaws.py"} "$@"\n'
    )
    wrapper.chmod(0o755)
    pytester.makepyfile(
        test_conformance=TEST_FILE.format(
            python=str(wrapper),
            backend=backend,
            options=options or {"dir": "vol-1"},
            fs_group=fs_group,
            secrets={"token": "kit-Secret-Token-42"} if secrets is None else secrets,
            extra=extra,
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(KITSITE))
    args = ["-p", "no:cacheprovider", "-q"]
    if select:
        args += ["-k", select]
    return pytester.runpytest_subprocess(*args, timeout=600)


def failed_checks(result: pytest.RunResult) -> list[str]:
    """The one-line failures the kit printed."""
    return [line for line in result.outlines if line.startswith("flexhub-kit ")]


def test_a_conforming_backend_passes_every_check(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_kit(pytester, monkeypatch, "kitgood")
    assert failed_checks(result) == [], result.stdout.str()
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) == 15 and "failed" not in outcomes, outcomes  # every check


def test_a_conforming_provisioning_backend_passes_the_provisioning_checks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_kit(pytester, monkeypatch, "kitprov", select="provision or reclaim")
    assert failed_checks(result) == [], result.stdout.str()
    assert result.parseoutcomes().get("passed") == 4, result.stdout.str()


def test_a_release_deferred_while_unreachable_and_finished_later_passes_bounded(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_kit(pytester, monkeypatch, "kitdeferblock", select="bounded")
    assert failed_checks(result) == [], result.stdout.str()
    assert result.parseoutcomes().get("passed") == 1, result.stdout.str()


#: (check, backend, driver flaw, options, -k selection, the line the kit must print)
BROKEN = [
    (
        "schema-lint",
        "kitnodesc",
        "",
        None,
        "schema_lint",
        "flexhub-kit schema-lint: option 'dir': no description; *; fix the backend's schema.json",
    ),
    (
        "sample-options",
        "kitgood",
        "",
        {"dir": "Not A Dir"},
        "sample_options",
        "flexhub-kit sample-options: the sample's options are refused: *dir*; give Sample.options*",
    ),
    (
        "init",
        "kitgood",
        "init-no-capabilities",
        None,
        "test_init",
        'flexhub-kit init: init replied exit 0, {"status":"Success"}; init must succeed with*',
    ),
    (
        "unmount-missing",
        "kitgood",
        "unmount-missing-fails",
        None,
        "unmount_missing",
        "flexhub-kit unmount-missing: unmount of a missing directory: exit 1, *no such file*",
    ),
    (
        "unmount-never-mounted",
        "kitgood",
        "unmount-unmounted-fails",
        None,
        "never_mounted",
        "flexhub-kit unmount-never-mounted: unmount of a never-mounted directory: *not mounted*",
    ),
    (
        "bad-options",
        "kitopen",
        "",
        None,
        "bad_options",
        "flexhub-kit bad-options: an unknown option was accepted: exit 0*additionalProperties*",
    ),
    (
        "sequence",
        "kittmpfs",
        "",
        None,
        "sequence",
        "flexhub-kit sequence: pod B does not see what pod A wrote on the same volume; *",
    ),
    (
        "idempotent",
        "kitgood",
        "mount-not-idempotent",
        None,
        "idempotency",
        "flexhub-kit idempotent: a second mount of a mounted directory: *already mounted*",
    ),
    (
        "idempotent-restart",
        "kitgood",
        "init-fails-while-mounted",
        None,
        "idempotency",
        "flexhub-kit idempotent: init failed after a mount (a kubelet restart); init must always*",
    ),
    (
        "crash-mount",
        "kitleakyblock",
        "",
        None,
        "crash_during_mount",
        "flexhub-kit crash-mount[[]attached]: after a SIGKILL at attached, a retry and an unmount,"
        " left behind: attached: /dev/loop* (*/storage/vol-1.img); unmount must undo*",
    ),
    (
        "crash-mount-not-killed",
        "kitgood",
        "ignores-crash-hook",
        None,
        "crash_during_mount",
        "flexhub-kit crash-mount[[]pod-record]: the call was not killed at pod-record: exit 0,*",
    ),
    (
        "crash-unmount",
        "kitleakyblock",
        "unmount-forgets-first",
        None,
        "crash_during_unmount",
        "flexhub-kit crash-unmount[[]unbound]: after a SIGKILL at unbound and a retried unmount,"
        " left behind: mounted: */state/staging/*, attached: /dev/loop*",
    ),
    (
        "bounded",
        "kithang",
        "",
        None,
        "bounded",
        "flexhub-kit bounded: mount took *s (bound 20s); bound every step of mount*",
    ),
    (
        "bounded",
        "kitneverblock",
        "",
        None,
        "bounded",
        "flexhub-kit bounded: after the calls with the storage unreachable, left behind: attached:"
        " /dev/loop* (*/storage/vol-1.img), recorded: */state/volumes/*.json; unmount must undo*",
    ),
    (
        "provision-idempotent",
        "kitprovleak",
        "",
        None,
        "provision_is_idempotent",
        "flexhub-kit provision-idempotent: the same claim provisioned twice gave Provisioned(*"
        " then Provisioned(*; find and return what the first call made*",
    ),
    (
        "provision-crash",
        "kitprovleak",
        "",
        None,
        "provision_retried",
        "flexhub-kit provision-crash: provisioning the claim again made */storage/pvc-*; find*",
    ),
    (
        "reclaim-gone",
        "kitprovgone",
        "",
        None,
        "reclaim_of_nothing",
        "flexhub-kit reclaim-gone: reclaim of storage already gone failed: */storage/pvc-* does"
        " not exist; reclaim must be idempotent*",
    ),
    (
        "secrets",
        "kitcreds",
        "",
        None,
        "sequence",
        "flexhub-kit secrets: after sequence, secret values shown: secret 'token' in"
        " */state/kit-credentials; never*",
    ),
]


@pytest.mark.parametrize(
    ("backend", "flaw", "options", "select", "line"),
    [pytest.param(*case[1:], id=case[0]) for case in BROKEN],
)
def test_each_check_fails_on_a_broken_backend(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    flaw: str,
    options: dict[str, str] | None,
    select: str,
    line: str,
) -> None:
    """The selected check fails, with exactly its one line; nothing else ran and failed."""
    result = run_kit(pytester, monkeypatch, backend, flaw=flaw, select=select, options=options)
    result.stdout.fnmatch_lines([line])
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1 and "error" not in outcomes, result.stdout.str()
    assert len(failed_checks(result)) in (1, 2), result.stdout.str()  # -q repeats it


def test_the_same_checks_pass_without_the_flaws(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above pass on the conforming backend and driver (so each failure above is
    the flaw's, not the selection's)."""
    selection = " or ".join(f"({case[4]})" for case in BROKEN)
    result = run_kit(pytester, monkeypatch, "kitgood", select=selection)
    assert failed_checks(result) == [], result.stdout.str()
    assert "failed" not in result.parseoutcomes(), result.stdout.str()


def test_sequence_fails_when_the_fs_group_pod_does_not_get_the_group(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kitgood bind-mounts a directory and ignores the pod's fsGroup: the sequence's fsGroup
    pod must see the group and g+rwxs on the volume's root (kit 1 only mounted that pod)."""
    result = run_kit(pytester, monkeypatch, "kitgood", select="sequence", fs_group=4242)
    result.stdout.fnmatch_lines(
        ["flexhub-kit sequence: in a pod with fsGroup 4242, the volume's root is group 0, *"]
    )
    assert result.parseoutcomes().get("failed") == 1, result.stdout.str()


def test_a_secret_scan_that_saw_no_secret_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sample without secrets gives the scan nothing to look for: that fails (before, the
    scan passed having scanned nothing, as the NFS kit's did)."""
    result = run_kit(pytester, monkeypatch, "kitgood", select="sequence", secrets={})
    result.stdout.fnmatch_lines(
        [
            "flexhub-kit secrets: sequence made no call carrying a secret, so nothing was"
            " scanned; give Sample.secrets *secrets_not_applicable*"
        ]
    )
    assert result.parseoutcomes().get("failed") == 1, result.stdout.str()


def test_a_secret_scan_declared_not_applicable_passes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend's kit class that says why its calls carry no secret passes without one."""
    extra = '    secrets_not_applicable = "kitgood reads no Secret"\n'
    result = run_kit(pytester, monkeypatch, "kitgood", select="sequence", secrets={}, extra=extra)
    assert failed_checks(result) == [], result.stdout.str()
    assert result.parseoutcomes().get("passed") == 1, result.stdout.str()

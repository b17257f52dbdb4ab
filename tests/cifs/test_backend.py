"""The cifs backend's mount and unmount with a recording runner: the password never reaches
an argv, the credentials file lives exactly as long as the mount command, failures are
clean. (Real mounts: tests/vm/test_cifs.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from flexhub.backend import CommandError, CommandTimeout, InvalidOptions
from tests.cifs.conftest import PASSWORD, Harness, failing, volume


def test_mount_passes_a_credentials_file_never_the_password(
    harness: Harness, tmp_path: Path
) -> None:
    target = tmp_path / "pod"
    target.mkdir()
    details = harness.backend.mount(target, volume({"vers": "3.0"}, fs_group=7))
    ((mode, text),) = harness.runner.seen_files
    assert mode == 0o600 and text == f"username=bob\npassword={PASSWORD}\n"
    (call,) = harness.runner.calls
    assert call[:4] == ["mount", "-t", "cifs", "-o"]
    assert call[5:] == ["--", "//files.example.com/team", str(target)]
    options = call[4].split(",")
    assert options[:-1] == [
        "vers=3.0",
        "hard",
        "gid=7",
        "file_mode=0770",
        "dir_mode=0770",
        "rw",
    ]
    assert options[-1].startswith(f"credentials={harness.state_dir}/cifs-creds/")
    assert not any(PASSWORD in arg or "Sup3r" in arg for arg in call)
    assert harness.cred_files() == []
    assert details == {
        "source": "//files.example.com/team",
        "server": "files.example.com",
        "vers": "3.1.1",
    }
    assert harness.backend.mount(target, volume({"vers": "3.0"})) == details  # idempotent
    assert len(harness.runner.calls) == 1


def test_wrong_password_fails_cleanly_and_removes_the_file(
    harness: Harness, tmp_path: Path
) -> None:
    target = tmp_path / "pod"
    target.mkdir()
    harness.runner.answer = failing("mount error(13): Permission denied")
    with pytest.raises(CommandError) as caught:
        harness.backend.mount(target, volume())
    assert "refused the Secret's username/password" in caught.value.message
    assert PASSWORD not in caught.value.message
    assert harness.cred_files() == []
    assert harness.runner.seen_files  # the file did exist during the command


def test_timeout_removes_the_file(harness: Harness, tmp_path: Path) -> None:
    target = tmp_path / "pod"
    target.mkdir()

    def hang(argv: list[str]) -> object:
        if argv[:3] == ["mount", "-t", "cifs"]:
            return CommandTimeout("mount timed out", returncode=None)
        return None

    harness.runner.answer = hang
    with pytest.raises(CommandTimeout, match="did not answer within 10s"):
        harness.backend.mount(target, volume())
    assert harness.cred_files() == []


def test_missing_secret_fails_before_any_command(harness: Harness, tmp_path: Path) -> None:
    with pytest.raises(InvalidOptions, match="needs a Secret"):
        harness.backend.check(volume(secrets={}))
    with pytest.raises(InvalidOptions, match="needs a Secret"):
        harness.backend.mount(tmp_path, volume(secrets={"username": "bob"}))
    assert harness.runner.calls == []


def test_leftover_file_of_a_killed_call_is_removed_by_unmount(
    harness: Harness, tmp_path: Path
) -> None:
    creds = harness.state_dir / "cifs-creds"
    creds.mkdir(mode=0o700)
    (creds / "999999999-5-0123456789abcdef.cred").write_text(f"password={PASSWORD}\n")
    harness.backend.unmount(tmp_path, {})
    assert harness.cred_files() == []


def test_unmount_of_a_dead_server_goes_forced_and_lazy(harness: Harness, tmp_path: Path) -> None:
    target = tmp_path / "pod"
    target.mkdir()
    harness.backend.mount(target, volume())
    harness.backend.node.is_corrupted = lambda path, timeout=5.0: True
    harness.runner.calls.clear()
    harness.backend.unmount(target, {})
    assert harness.runner.calls == [["umount", "-c", "-i", "-f", "-l", "--", str(target)]]


#: A password typed into mountOptions (it must never be quoted back).
TYPED = "Typed-Pw-4kq9"


@pytest.mark.parametrize(
    ("user", "needle"),
    [
        ({"vers": "1.0"}, "SMB1 (vers 1.0) is refused"),
        ({"mountOptions": "vers=1.0"}, "SMB1 is insecure"),
        ({"mountOptions": f"noatime,password={TYPED}"}, "credentials come only from"),
        ({"mountOptions": "uid=0"}, "use the option 'uid'"),
        ({"subPath": "../../etc"}, "subPath"),
    ],
)
def test_refused_options_fail_before_any_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: dict[str, str], needle: str
) -> None:
    """The kubelet path (moved from the VM, tests/vm/test_cifs.py: no command runs, so no real
    system is needed): SMB1, a credential or an ownership option in mountOptions and a path
    escape are a Failure naming the problem, never quoting the password, with no command run
    (a recording runner), nothing made in the pod directory and no credentials file."""
    import flexhub.node.services
    from flexhub.admin.harness import Kubelet, go_json
    from flexhub.driver import kubelet
    from flexhub.node.runner import RecordingRunner

    state = tmp_path / "state"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{state}"\nlog_dir = "{tmp_path / "log"}"\n')
    monkeypatch.setenv("FLEXHUB_CONFIG", str(config))
    monkeypatch.setattr(kubelet, "_CONFIG", [])
    runner = RecordingRunner()
    monkeypatch.setattr(flexhub.node.services, "SubprocessRunner", lambda timeout: runner)
    target = tmp_path / "pods" / "uid" / "volumes" / "k8s~flexhub" / "pv"
    target.mkdir(parents=True)
    base = {"backend": "cifs", "server": "files.example.com", "share": "team"}
    secrets = {"username": "bob", "password": PASSWORD}
    options = Kubelet.mount_options({**base, **user}, pv="pv", pod_uid="uid", secrets=secrets)
    reply = kubelet.handle([str(target), go_json(options)], kubelet.Call(operation="mount"))
    assert reply.status == "Failure" and needle in reply.message, reply.message
    assert PASSWORD not in reply.message and TYPED not in reply.message
    assert runner.calls == []
    assert list(target.iterdir()) == []
    assert list(state.rglob("*.cred")) == []

"""The kit's secret scan (check ``secrets``): after a check's calls, every reply and every file
under the state, log and plugin directories is searched for each of the sample's secret
values, raw and base64. A scan that saw no call carrying a secret fails: it would pass having
looked for nothing. A backend whose calls never carry a secret says so, and why, in its kit
class (``secrets_not_applicable``)."""

from __future__ import annotations

import base64
from collections.abc import Mapping

import pytest

from flexhub.testing.env import KitEnv, fail_line

__all__ = ["needles", "scan"]

_FIX_NONE = (
    "give Sample.secrets a value (kubelet hands a volume's Secret to every backend's mount, so "
    "any backend can carry one), or set secrets_not_applicable = '<why>' on the kit's class"
)


def _fail(what: str, fix: str) -> None:
    __tracebackhide__ = True
    pytest.fail(fail_line("secrets", what, fix), pytrace=False)


def needles(secrets: Mapping[str, str]) -> dict[str, bytes]:
    """Each secret value, raw and base64, by a name that shows the key, never the value."""
    found = {}
    for key, value in secrets.items():
        raw = value.encode()
        found[f"secret {key!r}"] = raw
        found[f"secret {key!r} (base64)"] = base64.b64encode(raw)
    return found


def scan(
    env: KitEnv, check: str, secrets: Mapping[str, str], since: int, not_applicable: str = ""
) -> None:
    """Fail unless the calls of ``check`` (``env.calls[since:]``) carried one of ``secrets``
    and none of them shows in a reply or a file the driver wrote. ``not_applicable`` (the kit
    class's reason why the backend's calls carry no secret) lets a sample without secrets pass;
    with secrets in the sample it changes nothing."""
    __tracebackhide__ = True
    looked_for = needles(secrets)
    if not looked_for:
        if not_applicable:
            return
        _fail(f"{check} made no call carrying a secret, so nothing was scanned", _FIX_NONE)
    calls = env.calls[since:]
    given = [c for c in calls if any(n in "\0".join(c.argv).encode() for n in looked_for.values())]
    if not given:
        _fail(
            f"{check} made no call with the sample's secrets to scan after",
            "a secret scan must follow calls that carry the secrets",
        )
    written = env.files_written()
    if not any(path.startswith(env.log_dir + "/") for path in written):
        _fail(
            f"no log file under {env.log_dir} to scan after {check}",
            "the kit's Host must list the files it writes (Host.list_files)",
        )
    found = []
    for call in calls:
        for name, needle in looked_for.items():
            if needle in call.output:
                found.append(f"{name} in the reply to {call.argv[1]}")
    for path in written:
        data = env.host.read_file(path) or b""
        for name, needle in looked_for.items():
            if needle in data:
                found.append(f"{name} in {path}")
    if found:
        _fail(
            f"after {check}, secret values shown: {', '.join(sorted(set(found)))}",
            "never put a secret in a message, log or state file (mask with secrets=[...])",
        )

"""The kit's pytest plugin (entry point ``pytest11``, name ``flexhub``): the two markers and
the fixtures of :class:`flexhub.testing.Conformance`.

Fixtures (override any of them in a ``conftest.py``):

* ``flexhub_host``: where the driver runs, a :class:`flexhub.testing.host.Host`
  (default: this machine);
* ``flexhub_python``: the interpreter the installed driver runs (default: this one);
* ``flexhub_env``: per test class, a driver installed on the host in a private directory with
  its own config, state, log, plugin and kubelet directories; removed afterwards, after every
  pod directory left is unmounted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flexhub.admin.harness import KUBELET_ENV
from flexhub.testing.env import KitEnv
from flexhub.testing.host import Host, LocalHost


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "flexhub_static: a flexhub conformance check that needs no storage"
    )
    config.addinivalue_line(
        "markers", "flexhub_storage: a flexhub conformance check that mounts the sample"
    )


@pytest.fixture(scope="class")
def flexhub_host() -> Host:
    return LocalHost()


@pytest.fixture(scope="class")
def flexhub_python() -> str | None:
    return None


@pytest.fixture(scope="class")
def flexhub_env(
    request: pytest.FixtureRequest, flexhub_host: Host, flexhub_python: str | None
) -> Iterator[KitEnv]:
    from flexhub.testing.conformance import Conformance
    from flexhub.testing.devices import block_devices

    cls = request.cls
    if cls is None or not issubclass(cls, Conformance) or not cls.backend:
        raise pytest.UsageError("flexhub_env is for subclasses of Conformance with a backend")
    base = flexhub_host.temp_dir()
    env = KitEnv(
        host=flexhub_host,
        base=base,
        backend=cls.backend,
        settings=cls().settings(base),
        python=flexhub_python,
        call_timeout=cls.call_timeout,
        overhead=cls.overhead,
        node_settings=cls.node_settings,
    )
    env.setup()
    if getattr(flexhub_host, "isolated", False):
        env.devices_at_start = block_devices(env)
    yield env
    from flexhub.testing.devices import detach_loops

    env.cleanup()
    for target in reversed(env.mounts_left()):  # left by a check that failed (and said so)
        env.host.run(["umount", target], env=KUBELET_ENV, timeout=60)
    detach_loops(env)
    left = env.teardown()
    if left:
        pytest.fail(f"flexhub-kit teardown: still mounted: {', '.join(left)}", pytrace=False)

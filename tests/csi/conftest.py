"""What the CSI tests share: a ``flexhub csi`` process serving a loopfile node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.csi.sanity import (
    LoopfilePlugin,
    loops_backed_under,
    node_config,
    start_plugin,
    stop_plugin,
)


@pytest.fixture
def loopfile_plugin(trusted_dir: Path) -> Iterator[LoopfilePlugin]:
    """``flexhub csi --mode both`` on a node config under ``trusted_dir`` (its socket
    ``csi.sock``, its log ``plugin.log``). After the test (its own clean-up done) the plugin is
    stopped, and no loop device may map a file under the directory nor any CSI record remain."""
    import grpc  # (as the tests that use it: collecting the others needs no gRPC)

    from flexhub.csi.proto import csi_pb2_grpc as rpc

    config = node_config(trusted_dir)
    endpoint = trusted_dir / "csi.sock"
    proc = start_plugin(config, endpoint, trusted_dir / "plugin.log")
    channel = grpc.insecure_channel(f"unix://{endpoint}")
    try:
        yield LoopfilePlugin(trusted_dir, rpc.ControllerStub(channel), rpc.NodeStub(channel))
    finally:
        channel.close()
        stop_plugin(proc)
    assert loops_backed_under(trusted_dir) == []
    assert not list((trusted_dir / "state" / "csi").rglob("*.json"))

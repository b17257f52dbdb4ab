"""`flexhub daemonset --config-from`: the chart's ConfigMap reaches the host, where the
driver kubelet runs reads it; a config flexhub would refuse never gets there."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexhub.admin.deploy import place_config
from flexhub.errors import FlexhubError


def test_the_config_is_written_whole_where_the_host_reads_it(tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir()
    source = tmp_path / "flexhub.toml"
    source.write_text('state_dir = "/var/lib/flexhub"\n[loopfile]\nroot = "/srv/lf"\n')
    place_config(host, source, "/etc/flexhub/flexhub.toml")
    placed = host / "etc/flexhub/flexhub.toml"
    assert placed.read_bytes() == source.read_bytes()
    assert placed.stat().st_mode & 0o777 == 0o644
    # again, with another text: replaced, nothing left beside it
    source.write_text('log_level = "debug"\n')
    place_config(host, source, "/etc/flexhub/flexhub.toml")
    assert placed.read_text() == 'log_level = "debug"\n'
    assert [p.name for p in placed.parent.iterdir()] == ["flexhub.toml"]


@pytest.mark.parametrize(
    ("text", "says"),
    [("state_dir = relative\n", "not valid TOML"), ("state_dri = '/x'\n", "state_dri")],
)
def test_a_config_flexhub_refuses_never_reaches_the_host(
    tmp_path: Path, text: str, says: str
) -> None:
    host = tmp_path / "host"
    (host / "etc/flexhub").mkdir(parents=True)
    (host / "etc/flexhub/flexhub.toml").write_text("# the node's config so far\n")
    source = tmp_path / "flexhub.toml"
    source.write_text(text)
    with pytest.raises(FlexhubError, match=says) as caught:
        place_config(host, source, "/etc/flexhub/flexhub.toml")
    assert "\n" not in str(caught.value)
    assert (host / "etc/flexhub/flexhub.toml").read_text() == "# the node's config so far\n"
    assert [p.name for p in (host / "etc/flexhub").iterdir()] == ["flexhub.toml"]


def test_a_missing_configmap_file_and_a_relative_host_path_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(FlexhubError, match="cannot read the node config"):
        place_config(tmp_path, tmp_path / "absent.toml", "/etc/flexhub/flexhub.toml")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(FlexhubError, match="absolute"):
        place_config(tmp_path, tmp_path / "c.toml", "etc/flexhub.toml")

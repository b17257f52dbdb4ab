"""The quick path (``flexhub.driver.quick``): ``init`` and an ``unmount`` with nothing to
unmount, answered without the dispatcher. Whatever it answers, the full path would have
answered the same; whatever it is unsure of goes the full way."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from flexhub.config import load_config
from flexhub.driver import quick
from flexhub.driver.call import Reply
from flexhub.driver.kubelet import CAPABILITIES
from flexhub.errors import FlexhubError
from tests.conftest import PYTHON, run_flexhub

PLAIN = """\
# written by an operator
state_dir = "/srv/flexhub/state"   # where records live
log_dir = '/srv/flexhub/log'
log_level = "debug"
lock_timeout = 20
call_timeout = 2.5
[loopfile]
root = "/srv/loopfiles"
isolation = "namespace"
[nfs]
allowed_servers = ["10.0.0.5", "nas.example"]
"""


def test_a_plain_config_reads_as_the_full_reader_reads_it() -> None:
    found = quick.read_plain_config(PLAIN)
    assert found == {
        "state_dir": "/srv/flexhub/state",
        "log_dir": "/srv/flexhub/log",
        "log_level": "debug",
        "lock_timeout": "20",
        "call_timeout": "2.5",
    }


@pytest.mark.parametrize(
    "text",
    [
        'state_dri = "/x"\n',  # unknown top-level key: the full reader names it
        'state_dir = "relative"\n',
        'log_level = "loud"\n',
        "lock_timeout = 0\n",
        "lock_timeout = -1\n",
        "lock_timeout = true\n",
        "lock_timeout = 1e3\n",
        "lock_timeout = 007\n",
        'state_dir = "/a"\nstate_dir = "/b"\n',  # repeated
        'state_dir = "/a\\tb"\n',  # an escape
        'state_dir = """/a"""\n',
        'state_dir = ["/a"]\n',
        'state_dir = { path = "/a" }\n',
        "[[loopfile]]\nroot = '/x'\n",
        "[loop file]\n",
        "[loopfile] x = 1\n",
        'state_dir = "/a" trailing\n',
        "just words\n",
        'state_dir = "/a\x01"\n',
        "a.b = 1\n",
    ],
)
def test_anything_not_plain_goes_the_full_way(text: str) -> None:
    assert quick.read_plain_config(text) is None


@pytest.mark.parametrize(
    "text",
    [
        PLAIN,
        "",
        "# only a comment\n",
        'state_dir = "/a"\r\nlog_dir = "/b"\r\n',
        "state_dir='/a'\n[loopfile]\n[iscsi]\nlogin_timeout = 10\n",
        'log_level = "warning"\nrelease_retry_interval = 30\n',
        'state_dir = "/a" # "quoted" in a comment\n',
    ],
)
def test_what_the_quick_reader_accepts_the_full_reader_accepts_alike(
    text: str, tmp_path: Path
) -> None:
    """Agreement on every plain text: same directories and level, and no error."""
    found = quick.read_plain_config(text)
    assert found is not None
    path = tmp_path / "flexhub.toml"
    path.write_text(text)
    full = load_config(path)
    assert str(full.state_dir) == found.get("state_dir", "/var/lib/flexhub")
    assert str(full.log_dir) == found.get("log_dir", "/var/log/flexhub")
    assert full.log_level == found.get("log_level", "info")


@pytest.mark.parametrize("text", ['state_dri = "/x"\n', "lock_timeout = 0\n", 'log_level = "x"\n'])
def test_texts_the_full_reader_refuses_are_never_quick(text: str, tmp_path: Path) -> None:
    path = tmp_path / "flexhub.toml"
    path.write_text(text)
    with pytest.raises(FlexhubError):
        load_config(path)
    assert quick.read_plain_config(text) is None


@pytest.mark.parametrize(
    "text",
    ["plain", 'quo"te', "back\\slash", "new\nline\ttab\x01\x1f\x7f", "ünï €", "\udcff", ""],
)
def test_json_strings_are_written_as_json_writes_them(text: str) -> None:
    assert quick.json_string(text) == json.dumps(text, ensure_ascii=False)


def test_the_init_reply_is_the_dispatchers() -> None:
    full = Reply(extra={"capabilities": dict(CAPABILITIES)}).to_json()
    out = subprocess.run(
        [PYTHON, "-I", "-m", "flexhub", "init"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "FLEXHUB_CONFIG": os.environ["FLEXHUB_CONFIG"]},
        cwd="/",
        check=True,
    )
    assert out.stdout == full + "\n"
    assert out.stderr == ""


def test_a_quick_unmount_is_logged_as_the_full_path_logs_it(
    node_tree: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "pods" / "uid" / "volumes" / "k8s~flexhub" / "vol"
    target.mkdir(parents=True)
    reply = run_flexhub(["unmount", f"{target}/"], node_tree["config"])
    assert reply.ok and reply.reply == {"status": "Success"}
    line = (node_tree["log"] / "flexhub.log").read_text().splitlines()[-1]
    assert " INFO flexhub.calls: call " in line
    record = json.loads(line.split(": call ", 1)[1])
    assert record["op"] == "unmount" and record["dir"] == str(target)
    assert record["status"] == "Success" and isinstance(record["ms"], float)
    assert set(record) == {
        "op",
        "backend",
        "volume",
        "pod",
        "dir",
        "status",
        "ms",
        "message",
        "time",
    }


def test_an_unmount_with_a_record_or_a_mount_goes_the_full_way(node_tree: dict[str, Path]) -> None:
    """The quick path only ever answers 'nothing to do': with a record it hands over."""
    from flexhub.node.fastpath import pod_record_name

    target = node_tree["kubelet"] / "pods" / "u" / "volumes" / "k8s~flexhub" / "v"
    target.mkdir(parents=True)
    record = Path(pod_record_name(node_tree["state"], str(target)))
    record.parent.mkdir(parents=True)
    record.write_text("{not json")
    assert quick.read_plain_config(node_tree["config"].read_text()) is not None
    os.environ["FLEXHUB_CONFIG"], saved = str(node_tree["config"]), os.environ["FLEXHUB_CONFIG"]
    try:
        assert quick.serve(["unmount", str(target)]) is None
        assert quick.serve(["unmount", "relative/dir"]) is None
        assert quick.serve(["unmount", "/a/../b"]) is None
        assert quick.serve(["mount", str(target), "{}"]) is None
        assert quick.serve(["init", "extra"]) is None
    finally:
        os.environ["FLEXHUB_CONFIG"] = saved


def test_a_config_that_is_not_plain_still_answers_through_the_full_path(tmp_path: Path) -> None:
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{tmp_path / "s"}"\nlog_dir = "{tmp_path / "l"}"\nx = [1]\n')
    reply = run_flexhub(["unmount", str(tmp_path / "nothing")], config)
    assert reply.reply["status"] == "Failure"
    assert "unknown setting 'x'" in reply.reply["message"]


#: Texts a hostile review found the first quick reader answering from while the full reader
#: refuses them (the quick unmount then said Success where the full one said Failure).
REFUSED_BY_TOML = [
    "lock_timeout = \u0663\n",  # ARABIC-INDIC DIGIT THREE: str.isdigit() and float() take it
    "call_timeout = 1\u06f5\n",
    'state_dir = "/a"\n[state_dir]\n',  # a table named like a top-level key
    "[loopfile]\n[loopfile]\n",  # a table declared twice
    '[loopfile]\nroot = "/a"\nroot = "/b"\n',  # a repeated backend key
    "[loopfile]\nroot = /not/toml\n",  # not a TOML value at all
    '[nfs]\nallowed_servers = ["a", b]\n',
    '[nfs]\nallowed_servers = ["a"\n',
]


@pytest.mark.parametrize("text", REFUSED_BY_TOML)
def test_what_toml_refuses_is_never_read_quickly(text: str, tmp_path: Path) -> None:
    path = tmp_path / "flexhub.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(FlexhubError):
        load_config(path)
    assert quick.read_plain_config(text) is None


@pytest.mark.parametrize(
    "text",
    [
        '[nfs]\nallowed_servers = ["10.0.0.5", "nas.example"]  # two\nretries = 3\n',
        "[iscsi]\nfencing = true\nlogin_timeout = 2.5\nports = [3260, 3261]\n",
        "[loopfile]\n[nfs]\n[cifs]\n",
    ],
)
def test_one_line_table_values_of_every_kind_flexhub_uses_are_plain(text: str) -> None:
    assert quick.read_plain_config(text) == {}


@pytest.mark.parametrize("value", ["/a//b", "/a/./b", "/a/../b", "/a/"])
def test_a_directory_not_written_as_pathlib_prints_it_goes_the_full_way(value: str) -> None:
    """The quick path compares directories as strings: only normal ones are compared."""
    assert quick.read_plain_config(f'state_dir = "{value}"\n') is None


def test_a_config_past_the_quick_limit_is_read_whole_by_the_full_path(tmp_path: Path) -> None:
    """A setting after a MiB of comments is never missed: the quick path does not decide on
    part of a file, and the full path, which reads it all, acts on the record."""
    state = tmp_path / "state"
    config = tmp_path / "flexhub.toml"
    padding = "#" + "-" * quick.MAX_CONFIG_BYTES + "\n"
    config.write_text(f'log_dir = "{tmp_path}/log"\n{padding}state_dir = "{state}"\n')
    assert load_config(config).state_dir == state
    os.environ["FLEXHUB_CONFIG"], saved = str(config), os.environ["FLEXHUB_CONFIG"]
    try:
        assert quick._config() is None
    finally:
        os.environ["FLEXHUB_CONFIG"] = saved


@pytest.mark.parametrize("umask", [0o022, 0])
def test_the_quick_log_makes_state_dir_private_whatever_the_umask(
    umask: int, tmp_path: Path
) -> None:
    """A log_dir inside state_dir: its missing directories are 0700 as the full path makes
    them (a first init under umask 0 once left state_dir 0777 for anyone to plant in)."""
    state = tmp_path / "state"
    config = tmp_path / "flexhub.toml"
    config.write_text(f'state_dir = "{state}"\nlog_dir = "{state}/log/calls"\n')
    proc = subprocess.run(
        [PYTHON, "-I", "-m", "flexhub", "init"],
        env={"PATH": "/usr/bin:/bin", "FLEXHUB_CONFIG": str(config)},
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.umask(umask),
        check=False,
    )
    assert '"Success"' in proc.stdout
    for directory in (state, state / "log", state / "log" / "calls"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert (state / "log" / "calls" / "flexhub.log").is_file()


def test_the_quick_reader_knows_the_settings_the_full_reader_knows() -> None:
    """The quick path cannot import flexhub.config (tomllib, pathlib), so it lists the
    top-level settings itself: the two lists must stay one."""
    from flexhub import config

    assert quick._NUMBERS == config._NUMBERS
    assert quick._LEVELS == config._LEVELS
    assert set(quick._STRINGS) == {"state_dir", "log_dir", "log_level"}
    assert set(config.NodeConfig.__slots__) - {"backends", "source"} == {
        *quick._STRINGS,
        *quick._NUMBERS,
    }


# -- the plain reader stands in for tomllib on every call (flexhub.config) --------------------

PLAIN_TEXTS = [
    PLAIN,
    "",
    "# only a comment\n",
    'state_dir = "/a"\r\nlog_dir = "/b"\r\n',
    "state_dir='/a'\n[loopfile]\n[iscsi]\nlogin_timeout = 10\n",
    'log_level = "warning"\nrelease_retry_interval = 30\n',
    'state_dir = "/a" # "quoted" in a comment\n',
    '[nfs]\nallowed_servers = ["10.0.0.5", "nas.example"]  # two\nretries = 3\n',
    "[iscsi]\nfencing = true\nlogin_timeout = 2.5\nports = [3260, 3261]\n",
    "[loopfile]\n[nfs]\n[cifs]\n",
    "[ t ]\na = -3\nb = +4\nc = -0\nd = 0\ne = -2.5\nf = false\ng = []\nh = [ 'x', \"y\", 1, ]\n",
    '[t]\ns = \'a"b\'\nu = "ä €"\nv = ["a\tb"]\n',
]


@pytest.mark.parametrize("text", PLAIN_TEXTS)
def test_the_plain_document_is_what_tomllib_reads(text: str) -> None:
    import tomllib

    from flexhub.node.plainconfig import plain_document

    assert plain_document(text) == tomllib.loads(text)
    # the same types too, in the tables as well (1 is not 1.0 nor True), in the same order
    assert repr(plain_document(text)) == repr(tomllib.loads(text))


@pytest.mark.parametrize(
    "text",
    [
        "# a comment with a control character \x01\n",
        'state_dir = "/a" # \x7f\n',
        "[t]\na = 1\r2\n",
        "[t]\na = inf\n",
        "[t]\na = 1_000\n",
        "[t]\na = 0x10\n",
        "[t]\na = 1e3\n",
        "[t]\na = 1979-05-27\n",
        "[t]\na = 01\n",
        "[t]\na = [1, [2]]\n",
        "[t]\na = {x = 1}\n",
        "[t]\n'a' = 1\n",
        "[t]\na.b = 1\n",
        "[t]\na = 1\na = 2\n",
        '[t]\na = ["\x01"]\n',
    ],
)
def test_what_the_plain_reader_does_not_read_exactly_goes_to_tomllib(text: str) -> None:
    from flexhub.node.plainconfig import plain_document

    assert plain_document(text) is None


def test_the_plain_reader_agrees_with_tomllib_on_random_texts() -> None:
    """Random lines of plain-looking pieces: every text the plain reader accepts, tomllib
    reads alike (value and type); the plain reader never accepts a text tomllib refuses."""
    import random
    import tomllib

    from flexhub.node.plainconfig import plain_document

    rng = random.Random(23)
    keys = ["state_dir", "log_dir", "log_level", "lock_timeout", "call_timeout", "root", "a", "b"]
    values = [
        '"/a"', "'/b/c'", '"info"', "'debug'", "10", "2.5", "0", "-1", "+2", "true", "false",
        "[]", "[1, 2]", '["x", \'y\']', "[1,]", '"a#b"', "1 # c", '"x" # "y"', "01", "1.", ".5",
        '"/a/"', '"rel"', "nan", '"\\t"', "[1", '"a', "x", "{}", "-0", "1.50", "007",
    ]  # fmt: skip
    pieces = ["", "# note", "[loopfile]", "[nfs]", "[ t ]", "[t] # c", "[[x]]", "[a.b]"]
    accepted = 0
    for _ in range(4000):
        lines = []
        for _ in range(rng.randrange(1, 6)):
            if rng.random() < 0.25:
                lines.append(rng.choice(pieces))
            else:
                lines.append(
                    f"{rng.choice(keys)}{rng.choice([' = ', '=', ' =  '])}{rng.choice(values)}"
                )
        text = "\n".join(lines) + rng.choice(["\n", "", "\r\n"])
        read = plain_document(text)
        if read is None:
            continue
        accepted += 1
        full = tomllib.loads(text)  # never raises on an accepted text
        assert repr(read) == repr(full), text  # values, types and order
    assert accepted > 100


@pytest.mark.parametrize("space", ["\u00a0", "\u2028", "\u3000", "\x85", "\u2009"])
def test_a_table_header_with_unicode_space_goes_the_full_way_and_is_refused(space: str) -> None:
    """TOML allows only space and tab around a table's name: a header such as
    ``[loopfile<NBSP>]`` (pasted from a web page) is not TOML, so the plain reader must not
    read it as ``[loopfile]`` and the full reader refuses the file, as the old driver did."""
    from flexhub.config import parse_config
    from flexhub.errors import FlexhubError
    from flexhub.node.plainconfig import plain_document

    text = f'state_dir = "/var/lib/flexhub"\n[loopfile{space}]\nroot = "/srv/x"\n'
    with pytest.raises(tomllib.TOMLDecodeError):
        tomllib.loads(text)
    assert plain_document(text) is None
    with pytest.raises(FlexhubError):
        parse_config(text.encode(), Path("/etc/flexhub/flexhub.toml"))

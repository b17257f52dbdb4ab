"""The state directory is made private: created 0700, wider modes tightened, nothing deeper."""

from __future__ import annotations

import stat
from pathlib import Path

from flexhub.node.statedir import PRIVATE_DIRS, secure_state_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_missing_state_dir_is_created_private(tmp_path: Path) -> None:
    state = tmp_path / "a" / "state"
    secure_state_dir(state)
    assert mode(state) == 0o700
    assert all(mode(state / name) == 0o700 for name in PRIVATE_DIRS)


def test_wide_modes_are_tightened_but_not_below_the_first_level(tmp_path: Path) -> None:
    state = tmp_path / "state"
    deep = state / "staging" / "0123abcd"  # a mount point: its mode is the volume's
    deep.mkdir(parents=True)
    for path in (state, state / "staging", deep):
        path.chmod(0o755)
    (state / "cache").mkdir(mode=0o775)
    secure_state_dir(state)
    assert mode(state) == mode(state / "staging") == mode(state / "cache") == 0o700
    assert mode(deep) == 0o755


def test_a_symlinked_state_dir_is_followed_and_a_symlinked_child_left_alone(
    tmp_path: Path,
) -> None:
    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere"
    real.mkdir(mode=0o755)
    real.chmod(0o755)
    elsewhere.mkdir()
    elsewhere.chmod(0o755)
    (real / "linked").symlink_to(elsewhere)
    state = tmp_path / "state"
    state.symlink_to(real)
    secure_state_dir(state)
    assert mode(real) == 0o700
    assert mode(elsewhere) == 0o755

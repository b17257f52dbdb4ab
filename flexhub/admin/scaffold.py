"""``flexhub new-backend NAME``: write a backend distribution that passes the kit's static checks.

The distribution ``flexhub-backend-NAME/`` holds ``pyproject.toml`` (the ``flexhub.backends``
entry point), the package ``flexhub_NAME`` (``schema.json`` and a working
:class:`~flexhub.backend.FilesystemBackend` that bind-mounts a directory under a node-wide
root; ``provision-schema.json`` and a :class:`~flexhub.provisioning.Provisioning` stub, not
mixed in yet, for dynamic provisioning), a README and ``tests/test_conformance.py`` using
:mod:`flexhub.testing`. The templates are package data (``flexhub/admin/scaffold_template``).
Nothing is written unless everything is: the tree is built in a temporary sibling directory
and renamed into place.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from importlib import metadata, resources
from pathlib import Path

from flexhub import __version__
from flexhub.errors import UsageError

__all__ = ["NAME_RULE", "check_name", "new_backend"]

#: What a backend name may be: it becomes the entry-point name and the package ``flexhub_NAME``.
NAME_RULE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
_MAX_NAME = 40
_GROUP = "flexhub.backends"

#: template file -> path in the distribution
_FILES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "backend.py.tmpl": "{package}/__init__.py",
    "schema.json.tmpl": "{package}/schema.json",
    "provision-schema.json.tmpl": "{package}/provision-schema.json",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
}


def check_name(name: str) -> None:
    """Refuse a name that is not a lowercase identifier or that an installed backend has.

    :raises UsageError: one line saying why.
    """
    if len(name) > _MAX_NAME or not NAME_RULE.fullmatch(name):
        raise UsageError(
            f"new-backend: {name[:_MAX_NAME]!r} is not a backend name: use lowercase letters, "
            f"digits and single '_' (starting with a letter, at most {_MAX_NAME}), e.g. mystore"
        )
    taken = {ep.name: ep.value for ep in metadata.entry_points(group=_GROUP)}
    if name in taken:
        raise UsageError(
            f"new-backend: a backend {name!r} is already installed ({taken[name]}); "
            "choose another name"
        )


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def new_backend(name: str, directory: Path) -> Path:
    """Write ``directory/flexhub-backend-NAME/`` and return its path.

    :raises UsageError: a bad name, a missing ``directory``, or a distribution directory that
        exists already; nothing is written then.
    """
    check_name(name)
    distribution = f"flexhub-backend-{name}"
    if not directory.is_dir():
        raise UsageError(f"new-backend: {directory} is not a directory")
    final = directory / distribution
    if final.exists() or final.is_symlink():
        raise UsageError(f"new-backend: {final} exists already; choose another name or --directory")
    values = {
        "name": name,
        "distribution": distribution,
        "package": f"flexhub_{name}",
        "Class": _class_name(name),
        "flexhub_version": __version__,
    }
    templates = resources.files("flexhub.admin").joinpath("scaffold_template")
    temp = directory / f".{distribution}.{secrets.token_hex(6)}.tmp"
    try:
        temp.mkdir()  # the umask's mode, as the final directory will have
    except OSError as exc:
        raise UsageError(f"new-backend: cannot write in {directory}: {exc.strerror}") from None
    try:
        for template, target in _FILES.items():
            text = templates.joinpath(template).read_text("utf-8")
            for key, value in values.items():
                text = text.replace("{{" + key + "}}", value)
            path = temp / target.format(package=values["package"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, "utf-8")
        (temp / values["package"] / "py.typed").write_text("", "utf-8")
        try:
            os.rename(temp, final)  # fails if final appeared meanwhile (non-empty or a file)
        except OSError as exc:
            raise UsageError(f"new-backend: cannot create {final}: {exc.strerror}") from None
    except OSError as exc:
        shutil.rmtree(temp, ignore_errors=True)
        raise UsageError(f"new-backend: cannot write {final}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final

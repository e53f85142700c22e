"""The output directory of a checkpoint build: what may be written into, and with which modes.

Kept free of torch and transformers, so the commands refuse an unusable directory at once rather
than after importing them (15 to 50 s on a busy 2-core machine).
"""

from __future__ import annotations

import os


def prepare_output(directory: str) -> str:
    """Refuse an output ``directory`` a build must not write into, else create its parent (where
    the build is staged) and return that parent. Raises ValueError for an empty path or a
    dangling symbolic link, FileExistsError (the project's own message) for a directory that
    exists and is not empty, and the operating system's OSError for a path that is not a
    directory or a parent that cannot be made."""
    _refuse_unnamed_target(directory)
    if os.path.exists(directory) and os.listdir(directory):
        raise FileExistsError(f"{directory} exists and is not empty")
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    return parent


def _refuse_unnamed_target(directory: str) -> None:
    """Refuse the paths that name no directory the build could be put in, before it starts: both
    got the whole build staged first and then failed naming a staging file, ``''`` after staging
    it next to the working directory's parent."""
    if not directory:
        raise ValueError("the output directory is an empty path ('')")
    if os.path.islink(directory) and not os.path.exists(directory):
        raise ValueError(
            f"the output directory {directory} is a symbolic link to {os.readlink(directory)}, which does not exist"
        )


def apply_umask(directory: str) -> None:
    """Give ``directory`` and everything under it the modes a plain ``mkdir`` and file write
    give under the current umask. A build staged in a ``mkdtemp`` directory (mode 0700) and
    written by safetensors (files 0600) was otherwise unreadable to a server running as another
    user (a container, a CI job serving what an earlier step built)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for root, subdirectories, files in os.walk(directory):
        for name in subdirectories:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def move_into_place(staging: str, directory: str) -> None:
    """Put a finished build at ``directory``: a rename when it is absent; else entry by entry into
    the caller's empty directory (kept: it may be a mount point or a shell's working directory),
    ``config.json`` last, so a reader that finds it finds the rest, and the entries moved taken
    back if one cannot follow."""
    if not os.path.lexists(directory):
        os.replace(staging, directory)
        return
    moved = []
    try:
        for entry in sorted(os.listdir(staging), key=lambda name: name == "config.json"):
            os.replace(os.path.join(staging, entry), os.path.join(directory, entry))
            moved.append(entry)
    except BaseException:
        for entry in moved:
            os.replace(os.path.join(directory, entry), os.path.join(staging, entry))
        raise
    os.rmdir(staging)

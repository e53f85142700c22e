"""One line for a command that could not write its output directory."""

from __future__ import annotations

import errno
import os


def _file_above(directory: str) -> str | None:
    """The nearest existing path above ``directory`` when it is not a directory (a plain file)."""
    path = os.path.dirname(os.path.abspath(directory))
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path if os.path.lexists(path) and not os.path.isdir(path) else None


def describe_write_error(directory: str, error: OSError) -> str:
    """The project's own refusals (a non-empty directory) carry their message and no errno. A
    path under a plain file is named so whichever call met it first (making the parent reports
    "File exists", writing into it "Not a directory"); any other error from the operating system
    names the directory asked for and what went wrong, with the path it hit when that is another."""
    if error.errno is None:
        return str(error)
    blocking = _file_above(directory) if error.errno in (errno.EEXIST, errno.ENOTDIR) else None
    if blocking is not None:
        return f"cannot write {directory}: {blocking} is a file, not a directory"
    hit = f" ({error.filename})" if error.filename and error.filename != directory else ""
    return f"cannot write {directory}: {error.strerror}{hit}"

"""One line for a command that could not write its output directory."""

from __future__ import annotations


def describe_write_error(directory: str, error: OSError) -> str:
    """The project's own refusals (a non-empty directory) carry their message and no errno; an
    error from the operating system names the directory asked for and what went wrong, with the
    path it hit when that is another one (a parent that is a file, say)."""
    if error.errno is None:
        return str(error)
    hit = f" ({error.filename})" if error.filename and error.filename != directory else ""
    return f"cannot write {directory}: {error.strerror}{hit}"

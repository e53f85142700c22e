"""``sglang-m3 inspect`` writes only its own output on stderr-free runs: SGLang's import- and
setup-time notes about serving on this machine (``sglang_m3.inspect.quiet``) are silenced while
inspect imports and sets SGLang up, and nothing else is.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from sglang_m3.inspect.quiet import IMPORT_WARNINGS, SERVER_ARGS_LOG_LINES, sglang_noise_silenced


@pytest.fixture(scope="module")
def tiny_mxfp8_checkpoint(tmp_path_factory):
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("inspect-quiet") / "mxfp8"), quantization="mxfp8")


@pytest.mark.parametrize(
    "checkpoint, flags",
    [
        ("tiny_m3_checkpoint", ()),
        # more noise: a quantized checkpoint, and two ranks (two resolutions of the server arguments)
        ("tiny_mxfp8_checkpoint", ("--tp", "2")),
    ],
    ids=["tiny", "tiny-mxfp8-tp2"],
)
def test_inspecting_a_tiny_checkpoint_writes_nothing_to_stderr(checkpoint, flags, request):
    """The command as a user runs it, in a fresh interpreter (import-time warnings fire once per
    process). TRITON_INTERPRET is the test session's own setting (tests/conftest.py), not a user's."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "sglang_m3.cli", "inspect", request.getfixturevalue(checkpoint), *flags],
        capture_output=True, text=True, env=environment, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("MiniMaxM3SparseForCausalLM from ")


def test_only_the_known_import_warnings_are_silenced_and_only_inside():
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with sglang_noise_silenced():
            for message in IMPORT_WARNINGS:
                warnings.warn(message, UserWarning)
            warnings.warn(IMPORT_WARNINGS[0] + " And more.", UserWarning)
            warnings.warn("some other warning", UserWarning)
        warnings.warn(IMPORT_WARNINGS[0], UserWarning)
    assert [str(warning.message) for warning in shown] == [
        IMPORT_WARNINGS[0] + " And more.",
        "some other warning",
        IMPORT_WARNINGS[0],
    ]


def test_filters_that_imported_libraries_install_stay():
    """Libraries imported in the block add their own warning filters (numpy, urllib3, torch do):
    those stay after it, only the block's own are taken out."""
    with warnings.catch_warnings():
        before = list(warnings.filters)
        with sglang_noise_silenced():
            warnings.filterwarnings("ignore", message="a library's own filter")
            library_filter = warnings.filters[0]
        assert warnings.filters == [library_filter, *before]


def test_only_the_known_log_lines_are_dropped_and_only_inside(caplog):
    expected = []
    with caplog.at_level(logging.INFO):
        with sglang_noise_silenced():
            for name, templates in SERVER_ARGS_LOG_LINES.items():
                logger = logging.getLogger(name)
                for template in templates:
                    logger.warning(template, *(["mxfp8"] if "%s" in template else []))
                logger.warning("another line of %s", name)
                logging.getLogger("sglang.srt.server_args").warning(templates[0])
                expected += [(name, f"another line of {name}"), ("sglang.srt.server_args", templates[0])]
        for name, templates in SERVER_ARGS_LOG_LINES.items():
            logging.getLogger(name).warning(templates[0])
            expected.append((name, templates[0]))
    assert [(record.name, record.getMessage()) for record in caplog.records] == expected

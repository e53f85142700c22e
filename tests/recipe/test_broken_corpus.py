"""Every file in broken/ is refused with the error its header names, and nothing is rendered.

Each file starts with ``# expect-field: FIELD`` and ``# expect-message: TEXT``: some error of
the file (a load problem or an error finding) must sit at FIELD and contain TEXT.
"""

from __future__ import annotations

import json

import pytest

from sglang_m3.commands.recipe import check_file
from tests.recipe.cli_runner import run_cli
from tests.recipe.recipe_factory import BROKEN

CASES = sorted(BROKEN.glob("*.yaml"))


def expectation(path) -> tuple[str, str]:
    header = dict(
        line[2:].split(": ", 1)
        for line in path.read_text().splitlines()
        if line.startswith("# expect-")
    )
    return header["expect-field"], header["expect-message"]


def errors_of(result: dict) -> list[tuple[str, str]]:
    errors = [(p["field"], p["message"]) for p in result["problems"]]
    errors += [(f["field"], f["message"]) for f in result["findings"] if f["severity"] == "error"]
    return errors


def test_corpus_is_large_and_covers_every_category():
    assert len(CASES) >= 30
    fields = {expectation(path)[0] for path in CASES}
    # YAML errors, empty files, wrong kind, unknown fields, wrong types, parallelism, variant,
    # context, speculative, extra args
    for needed in ("<yaml>", "<file>", "kind", "spec.tensorParallel", "spec.parallelism.tp",
                   "spec.parallelism", "spec.model.variant", "spec.contextLength",
                   "spec.speculative.draftModel", "spec.serving.extraArgs[0]"):
        assert needed in fields, needed


@pytest.mark.parametrize("path", CASES, ids=lambda path: path.stem)
def test_broken_recipe_is_rejected_with_its_message(path):
    field, message = expectation(path)
    result = check_file(path)
    assert not result["ok"]
    errors = errors_of(result)
    assert any(f == field and message in m for f, m in errors), errors


@pytest.mark.parametrize("path", CASES, ids=lambda path: path.stem)
def test_broken_recipe_renders_nothing(path, capsys):
    code, out, err = run_cli(capsys, "render", str(path))
    assert code == 1
    assert out == ""  # nothing half-written on stdout
    assert str(path) in err


def test_validate_reports_every_broken_file_as_json(capsys):
    code, out, _ = run_cli(capsys, "validate", str(BROKEN), "--output", "json")
    assert code == 1
    results = json.loads(out)
    assert [r["file"] for r in results] == [str(path) for path in CASES]
    assert not any(r["ok"] for r in results)

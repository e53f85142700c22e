"""``serving.extraArgs`` is checked against the options the pinned SGLang accepts.

The recipe layer reads SGLang's options from ``sglang_m3/recipe/data/sglang_options.json``
(it may not import SGLang); the first test keeps that record equal to the installed SGLang's
own parser (``M3_UPDATE_SGLANG_OPTIONS=1`` rewrites it after an upgrade: review the diff). The
others show that an extra argument SGLang would refuse at start-up (an option it does not know,
an abbreviation of several, a switch given a value, an option missing its value, a stray word)
is refused by ``recipe validate`` naming its index, and that what SGLang accepts passes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import validate_recipe
from sglang_m3.recipe.sglang_options import OPTIONS, OPTIONS_PATH, SGLANG_VERSION
from tests.recipe.recipe_factory import make_recipe


def sglang_option_arities() -> dict[str, str]:
    """Every option of SGLang's server parser with how many values it takes (help left out)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    arities = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        nargs = action.nargs
        arity = {0: "none", None: "one", 1: "one", "?": "optional", "*": "many", "+": "many"}.get(nargs, "many")
        for option in action.option_strings:
            arities[option] = arity
    return dict(sorted(arities.items()))


def test_option_record_is_the_installed_sglangs():
    sglang = pytest.importorskip("sglang")
    pytest.importorskip("sglang.srt.server_args")
    installed = sglang_option_arities()
    if os.environ.get("M3_UPDATE_SGLANG_OPTIONS"):
        document = {"generated_by": "tests/recipe/test_sglang_options.py from SGLang's own parser "
                                    "(M3_UPDATE_SGLANG_OPTIONS=1 rewrites it; do not edit by hand)",
                    "sglang_version": sglang.__version__, "options": installed}
        OPTIONS_PATH.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    assert SGLANG_VERSION == sglang.__version__ == "0.5.23"
    assert OPTIONS == installed


def extra_arg_errors(extra_args: list[str]) -> list[tuple[str, str, str]]:
    recipe = make_recipe(spec__serving={"memFractionStatic": 0.8, "maxRunningRequests": 8,
                                        "extraArgs": extra_args})
    return [(f.field, f.rule, f.message) for f in validate_recipe(recipe) if f.severity == "error"]


ACCEPTED = [
    ["--enable-metrics"],
    ["--log-level", "debug"],
    ["--log-level=debug"],
    ["--cuda-graph-max-bs-decode", "256", "--enable-metrics"],
    ["--max-prefill", "16384"],                       # argparse expands a unique prefix
    ["--json-model-override-args", '{"a": 1}'],
    ["--schedule-conservativeness", "-0.5"],          # a negative number is a value
]


@pytest.mark.parametrize("extra_args", ACCEPTED)
def test_extra_args_sglang_accepts_pass(extra_args):
    assert extra_arg_errors(extra_args) == []


REFUSED = [
    (["--enable-metrics", "--no-such-option"], 1, "not a server option of SGLang 0.5.23"),
    (["--log-levl", "debug"], 0, "not a server option of SGLang 0.5.23"),
    (["--help"], 0, "not a server option of SGLang 0.5.23"),
    (["-x"], 0, "not a server option of SGLang 0.5.23"),
    (["--enable-me"], 0, "abbreviates"),              # --enable-metrics, --enable-memory-saver, ...
    (["--enable-metrics", "true"], 1, "takes no value"),
    (["--enable-metrics=true"], 0, "takes no value"),
    (["--log-level"], 0, "needs a value"),
    (["--log-level", "--enable-metrics"], 0, "needs a value"),
    (["debug"], 0, "not an option"),
    (["--log-level", "debug", "info"], 2, "not an option"),
    (["--cuda-graph-max-bs", "256"], 0, "abbreviates"),  # 0.5.23 splits it into -decode / -prefill
]


@pytest.mark.parametrize("extra_args, index, words", REFUSED)
def test_extra_args_sglang_refuses_are_refused_by_index(extra_args, index, words):
    errors = extra_arg_errors(extra_args)
    fields = {field for field, _, message in errors if words in message}
    assert fields == {f"spec.serving.extraArgs[{index}]"}, errors


def sglang_parser_accepts(extra_args: list[str]) -> bool:
    from sglang.srt.server_args import prepare_server_args

    try:
        prepare_server_args(["--model-path", "MiniMaxAI/MiniMax-M3", *extra_args])
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize("extra_args", [
    *ACCEPTED,
    *(case[0] for case in REFUSED),
])
def test_the_verdict_is_sglangs_own(extra_args, capsys):
    """Differential: SGLang's own parser (``prepare_server_args``) accepts exactly the extra
    arguments the recipe rules accept."""
    pytest.importorskip("sglang.srt.server_args")
    accepted = sglang_parser_accepts(extra_args)
    capsys.readouterr()
    assert accepted == (extra_arg_errors(extra_args) == [])


#: Options outside the typed fields (those are the typed check's), with a value each accepts.
#: An option that takes a value is drawn with a valid one (or last, with none): the property is
#: about the command line's shape, which is what the rules judge, not about the values' types.
_SWITCHES = ["--enable-metrics", "--skip-server-warmup", "--enable-memory-saver", "--disable-cuda-graph"]
_WITH_VALUE = [("--log-level", "debug"), ("--cuda-graph-max-bs-decode", "8"), ("--schedule-conservativeness", "-0.5")]
_ODD = ["true", "8", "-x", "--enable-me", "--log-lev", "--no-such-option", "--enable-metrics=1",
        "--log-level=info", "-", "-7"]
_UNITS = st.one_of(
    st.sampled_from(_SWITCHES).map(lambda switch: [switch]),
    st.sampled_from(_WITH_VALUE).map(list),
    st.sampled_from(_ODD).map(lambda token: [token]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=st.lists(_UNITS, max_size=4),
       last=st.one_of(st.just([]), st.sampled_from(_WITH_VALUE).map(lambda pair: [pair[0]])))
def test_random_extra_args_get_sglangs_verdict(units, last):
    pytest.importorskip("sglang.srt.server_args")
    extra_args = [token for unit in units for token in unit] + last
    with contextlib.redirect_stderr(io.StringIO()):
        accepted = sglang_parser_accepts(extra_args)
    assert accepted == (extra_arg_errors(extra_args) == []), extra_args

"""The recipe layer's table of the plugin's switches (``plugin_switches``) against the plugin itself.

The plugin reads its ``SGLANG_M3_*`` switches at start-up in modules that import torch, so the recipe
layer states what each takes; these tests hold that statement to the plugin's code: the switch names
and choices in the plugin's ``env_switch`` calls, the parsing of those readers, and the two switches
the plugin checks with code of its own.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sglang_m3
from sglang_m3 import env_switch
from sglang_m3.recipe.plugin_switches import PLUGIN_SWITCHES
from sglang_m3.recipe.render import TYPED_ENV

PACKAGE = Path(sglang_m3.__file__).parent
#: The plugin's code, without the recipe layer (which reads no switch) and the readers themselves.
SOURCES = sorted(path for path in PACKAGE.rglob("*.py")
                 if "recipe" not in path.relative_to(PACKAGE).parts and path.name != "env_switch.py")
READERS = ("env_choice", "env_non_negative_int", "env_number")
#: ``SGLANG_M3_*`` names the plugin's code holds that are not switches of the server: the cache
#: directory of ``sglang-m3 serve``'s tiny checkpoint.
NOT_SWITCHES = {"SGLANG_M3_CACHE"}


def module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    return {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


#: Module-level constants of the whole package, for names a module imports from another.
PACKAGE_CONSTANTS = {name: value for path in PACKAGE.rglob("*.py")
                     for name, value in module_constants(ast.parse(path.read_text())).items()}


@functools.cache
def env_switch_reads() -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """Every switch the plugin reads through ``env_switch``: name -> (reader, choices)."""
    reads = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        constants = {**PACKAGE_CONSTANTS, **module_constants(tree)}

        def literal(node):
            return ast.literal_eval(constants[node.id] if isinstance(node, ast.Name) else node)

        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in READERS:
                choices = literal(node.args[1]) if node.func.id == "env_choice" else None
                reads[literal(node.args[0])] = (node.func.id, choices)
    return reads


def test_the_table_holds_every_switch_the_plugin_reads_with_env_switch():
    reads = env_switch_reads()
    assert len(reads) >= 15  # the scan found the plugin's readers
    for name, (reader, choices) in reads.items():
        if name in TYPED_ENV:
            continue  # a typed field renders it; env may not set it
        assert name in PLUGIN_SWITCHES, f"{name} ({reader}) is missing from PLUGIN_SWITCHES"
        if reader == "env_choice":
            assert PLUGIN_SWITCHES[name].choices == choices, name
            assert not PLUGIN_SWITCHES[name].stripped, name
        else:
            assert reader == "env_non_negative_int" and not PLUGIN_SWITCHES[name].choices, name


def test_every_switch_the_plugin_names_is_in_the_table():
    """A switch read with code of its own (not ``env_switch``) is caught here by its name."""
    named = {name for path in SOURCES for name in re.findall(r'"(SGLANG_M3_[A-Z0-9_]+)"', path.read_text())}
    assert named - NOT_SWITCHES - set(TYPED_ENV) == set(PLUGIN_SWITCHES)


VALUES = st.one_of(st.text(max_size=6), st.sampled_from(["0", "1", " 1", "1 ", "msa", "sglang", "fused", "-1",
                                                          "7", " 12 ", "1_000", "+3", "0x10", "1.0", ""]))


@settings(max_examples=300, deadline=None)
@given(value=VALUES)
def test_each_switch_takes_what_its_env_switch_reader_takes(value):
    if "\0" in value:
        return  # the environment cannot hold it, nor a pod spec's env
    reads = env_switch_reads()
    for name, switch in PLUGIN_SWITCHES.items():
        if name not in reads:
            continue  # read with the plugin's own code: the test below
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(name, value)
            try:
                if switch.choices:
                    env_switch.env_choice(name, switch.choices)
                else:
                    env_switch.env_non_negative_int(name, 0)
                read = True
            except ValueError:
                read = False
        assert switch.accepts(value) == read, (name, value)


def own_readers():
    """The switches the plugin checks with code of its own, each with its reader."""
    import torch

    from sglang_m3.models.fused_attn_ops import FUSED_ATTN_OPS_ENV, fused_attn_ops_on
    from sglang_m3.models.fused_norm import FUSED_NORM_ENV, fused_norm_on

    x = torch.zeros(1)
    return {FUSED_ATTN_OPS_ENV: lambda: fused_attn_ops_on(x), FUSED_NORM_ENV: lambda: fused_norm_on(x)}


@pytest.mark.parametrize("value", ["0", "1", " 1 ", "\t0", "", "on", "true", "2", "01", "1.0"])
def test_the_switches_with_their_own_check_take_what_it_takes(value):
    readers = own_readers()
    assert set(readers) == set(PLUGIN_SWITCHES) - set(env_switch_reads())
    for name, read in readers.items():
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(name, value)
            try:
                read()
                taken = True
            except ValueError:
                taken = False
        assert PLUGIN_SWITCHES[name].accepts(value) == taken, (name, value)

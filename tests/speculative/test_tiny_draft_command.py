"""``sglang-m3 tiny-draft TARGET DIR`` on bad input: one line naming the argument or path at fault,
exit 1 (argparse's 2 for a malformed value), and nothing under DIR unless the draft is whole.

(``tests/test_tiny_commands.py`` covers a missing target, an impossible DIR and a disk filling up
part-way.)
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from sglang_m3.cli import main


@pytest.fixture
def out(tmp_path):
    return tmp_path / "draft"


def _run(*args) -> int:
    return main(["tiny-draft", *map(str, args)])


def _target_with_config(directory, config) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(directory)


def test_a_target_that_is_not_m3_is_refused_naming_it(tmp_path, out, capsys):
    llama = _target_with_config(tmp_path / "llama", {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    })
    assert _run(llama, out) == 1
    assert capsys.readouterr().err.strip() == (
        f"sglang-m3 tiny-draft: {llama}: architectures ['LlamaForCausalLM'] is not an M3 checkpoint "
        "(MiniMaxM3SparseForCausalLM or MiniMaxM3SparseForConditionalGeneration); TARGET must be one"
    )
    assert not out.exists()


def test_a_target_config_that_is_not_json_is_refused_naming_the_file(tmp_path, out, capsys):
    target = _target_with_config(tmp_path / "broken", "{")
    assert _run(target, out) == 1
    assert capsys.readouterr().err.startswith(f"sglang-m3 tiny-draft: {target}/config.json is not valid JSON (")
    assert not out.exists()


def test_an_m3_config_without_a_field_names_the_target(tmp_path, out, capsys):
    target = _target_with_config(tmp_path / "partial", {"architectures": ["MiniMaxM3SparseForCausalLM"], "hidden_size": 128})
    assert _run(target, out) == 1
    assert capsys.readouterr().err.strip() == f"sglang-m3 tiny-draft: {target}: config field 'num_hidden_layers' is missing"
    assert not out.exists()


def test_aux_layers_past_the_target_are_refused_naming_the_flag(tiny_m3_checkpoint, out, capsys):
    assert _run(tiny_m3_checkpoint, out, "--aux-layer-ids", "1,9") == 1
    assert capsys.readouterr().err.strip() == (
        "sglang-m3 tiny-draft: --aux-layer-ids 1,9 names layer(s) [9] outside the target's layers 0 .. 3 "
        "(num_hidden_layers 4)"
    )
    assert not out.exists()


@pytest.mark.parametrize("text", [",", " "])
def test_aux_layer_ids_naming_no_layer_are_refused_by_argparse(tiny_m3_checkpoint, out, capsys, text):
    with pytest.raises(SystemExit) as exit_info:
        _run(tiny_m3_checkpoint, out, "--aux-layer-ids", text)
    assert exit_info.value.code == 2
    assert "argument --aux-layer-ids: names no layer" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("size", ["0", "513", "-3"])
def test_a_draft_vocabulary_outside_the_targets_is_refused(tiny_m3_checkpoint, out, capsys, size):
    assert _run(tiny_m3_checkpoint, out, "--draft-vocab-size", size) == 1
    assert capsys.readouterr().err.strip() == (
        f"sglang-m3 tiny-draft: --draft-vocab-size must be in 1 .. 512 (the target's vocab_size), got {size}"
    )
    assert not out.exists()


@pytest.mark.parametrize("existing", [False, True], ids=["absent", "empty"])
def test_dir_holds_nothing_until_the_draft_is_whole(tiny_m3_checkpoint, out, monkeypatch, existing):
    """The draft is written beside DIR and moved in whole: a server (or a killed build) never finds
    weights without their config.json in DIR."""
    from sglang_m3.speculative import tiny_draft

    if existing:
        out.mkdir()
    seen_while_writing = []
    dump = tiny_draft.json.dump

    def watching_dump(*args, **kwargs):
        seen_while_writing.append(sorted(os.listdir(out)) if out.exists() else None)
        return dump(*args, **kwargs)

    monkeypatch.setattr(tiny_draft.json, "dump", watching_dump)
    assert _run(tiny_m3_checkpoint, out) == 0
    assert seen_while_writing == [[] if existing else None]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_progress_is_reported_before_the_result(tiny_m3_checkpoint, out, capsys):
    assert _run(tiny_m3_checkpoint, out, "--draft-vocab-size", "300") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"reading target {tiny_m3_checkpoint}: hidden_size 128, vocab_size 512, 4 layers"
    assert lines[1] == "building a random draft (seed 0): draft vocabulary 300, aux layers 2, 2, 1 (M3's default)"
    assert lines[2] == f"writing {out}"
    assert lines[3] == f"wrote tiny EAGLE3 draft (random (seed 0)) for {tiny_m3_checkpoint} to {out}"


@pytest.mark.parametrize("existing", [False, True])
def test_the_draft_is_readable_as_the_umask_allows(tiny_m3_checkpoint, out, existing):
    """Built in a staging directory and written by safetensors (0600), it was unreadable to a server
    running as another user."""
    if existing:
        out.mkdir()
    previous = os.umask(0o022)
    try:
        assert _run(tiny_m3_checkpoint, out) == 0
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}
    if not existing:
        assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_help_says_what_target_needs_and_how_to_serve_the_draft(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-draft", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "TARGET" in text and "DIR" in text
    assert "config.json" in text and "lm_head.weight" in text  # what TARGET must hold
    assert "--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR" in text
    assert "exit status 1" in text

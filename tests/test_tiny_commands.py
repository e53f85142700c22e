"""``sglang-m3 tiny-checkpoint`` / ``tiny-draft`` on bad paths: one line naming the path, exit 1,
nothing written; and what a build says and leaves (progress first, modes as the umask allows)."""

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from sglang_m3.cli import main


def under_a_file(tmp_path):
    """A path that cannot be created whoever runs the test: its parent is a regular file."""
    (tmp_path / "plain-file").write_text("")
    return str(tmp_path / "plain-file" / "out")


def test_tiny_checkpoint_into_an_impossible_path(tmp_path, capsys):
    out = under_a_file(tmp_path)
    assert main(["tiny-checkpoint", out]) == 1
    # the parent it had to create is a file: named beside the directory asked for
    assert capsys.readouterr().err.strip() == f"sglang-m3 tiny-checkpoint: cannot write {out}: {tmp_path / 'plain-file'} is a file, not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain-file"]


def test_tiny_draft_for_a_directory_without_a_checkpoint(tmp_path, capsys):
    assert main(["tiny-draft", str(tmp_path), str(tmp_path / "draft")]) == 1
    err = capsys.readouterr().err
    assert f"sglang-m3 tiny-draft: {tmp_path}: no config.json there" in err
    assert not (tmp_path / "draft").exists()


@pytest.mark.parametrize("missing", ["/nonexistent-m3-target"])
def test_tiny_draft_for_a_missing_target(missing, tmp_path, capsys):
    assert main(["tiny-draft", missing, str(tmp_path / "draft")]) == 1
    assert f"{missing}: no config.json there" in capsys.readouterr().err


def test_tiny_draft_into_an_impossible_path(tmp_path, capsys):
    target = str(tmp_path / "target")
    assert main(["tiny-checkpoint", target]) == 0
    capsys.readouterr()
    out = under_a_file(tmp_path)
    assert main(["tiny-draft", target, out]) == 1
    # the same line as tiny-checkpoint's
    assert capsys.readouterr().err.strip() == f"sglang-m3 tiny-draft: cannot write {out}: {tmp_path / 'plain-file'} is a file, not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain-file", "target"]


def test_a_non_empty_directory_keeps_the_commands_own_message(tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("mine")
    assert main(["tiny-checkpoint", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"sglang-m3 tiny-checkpoint: {tmp_path} exists and is not empty"
    assert (tmp_path / "kept.txt").read_text() == "mine"


@pytest.mark.parametrize("count", ["-1", "two"])
def test_tiny_checkpoint_refuses_a_bad_mtp_module_count(count, tmp_path, capsys):
    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-checkpoint", str(out), "--mtp-modules", count])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --mtp-modules:" in err and count in err
    assert not out.exists()


@pytest.mark.parametrize("command", ["tiny-checkpoint", "tiny-draft"])
@pytest.mark.parametrize("seed", [str(2**70), "-1", "1.5"])
def test_tiny_commands_refuse_a_seed_torch_cannot_take(command, seed, tmp_path, capsys):
    """torch.manual_seed overflows past 2**63 - 1 ("Overflow when unpacking long long", no option
    named): argparse refuses such a seed by name, before anything is written."""
    out = tmp_path / "out"
    args = [command, str(out), "--seed", seed] if command == "tiny-checkpoint" else [command, str(tmp_path / "target"), str(out), "--seed", seed]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed:" in err and seed in err
    assert not out.exists()


def test_tiny_checkpoint_names_both_flags_for_mtp_modules_in_the_hf_layout(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["tiny-checkpoint", str(out), "--layout", "hf", "--mtp-modules", "1"]) == 2
    err = capsys.readouterr().err
    assert "--mtp-modules 1 needs --layout shipped (got --layout hf)" in err
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("target") / "m3")
    assert main(["tiny-checkpoint", target]) == 0
    return target


def _disk_full_at_config_json(monkeypatch):
    """model.safetensors is written, then config.json fails as on a full disk."""
    from sglang_m3.speculative import tiny_draft

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiny_draft.json, "dump", full)


@pytest.mark.parametrize("existing", [False, True], ids=["absent", "empty"])
def test_tiny_draft_failing_part_way_leaves_nothing_behind(existing, tiny_target, tmp_path, capsys, monkeypatch):
    out = tmp_path / "draft"
    if existing:
        out.mkdir()
    capsys.readouterr()
    _disk_full_at_config_json(monkeypatch)
    assert main(["tiny-draft", tiny_target, str(out)]) == 1
    assert capsys.readouterr().err.strip() == f"sglang-m3 tiny-draft: cannot write {out}: No space left on device"
    if existing:  # the caller's empty directory stays, empty
        assert out.is_dir() and not any(out.iterdir())
    else:
        assert not out.exists()
    monkeypatch.undo()
    # so the same command succeeds once the disk has room again
    assert main(["tiny-draft", tiny_target, str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_tiny_checkpoint_is_readable_as_the_umask_allows(tmp_path, capsys):
    """Built in a ``mkdtemp`` directory (mode 0700) by safetensors (files 0600), the checkpoint
    was unreadable to a server running as another user; it gets the modes a plain mkdir and
    file write give."""
    out = tmp_path / "ckpt"
    previous = os.umask(0o022)
    try:
        assert main(["tiny-checkpoint", str(out)]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


def test_tiny_checkpoint_says_what_it_writes_before_the_slow_imports(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["tiny-checkpoint", str(out), "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"sglang-m3 tiny-checkpoint: writing a tiny text-only M3 checkpoint to {out} ...\n")
    assert captured.out == f"wrote tiny text-only M3 checkpoint (seed 3, shipped layout) to {out}\n"


@pytest.mark.parametrize("existing", ["non-empty", "file"])
def test_an_unusable_directory_is_refused_before_torch_is_imported(existing, tmp_path):
    """Refusing a non-empty directory took as long as a build (torch and transformers imported
    first: 15 to 50 s on a busy 2-core machine)."""
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("")
    else:
        out.mkdir()
        (out / "kept.txt").write_text("mine")
    probe = (
        "import sys; from sglang_m3.cli import main; "
        f"status = main(['tiny-checkpoint', {str(out)!r}]); print(status, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout == "1 False\n", done.stderr
    assert done.stderr.startswith(f"sglang-m3 tiny-checkpoint: {out} exists and is not empty" if existing == "non-empty"
                                  else f"sglang-m3 tiny-checkpoint: cannot write {out}: Not a directory")


@pytest.mark.parametrize("content", [b"garbage", b"\xff" * 16], ids=["text", "huge-header"])
def test_tiny_draft_names_a_corrupt_tensor_file_of_the_target(content, tiny_target, tmp_path, capsys):
    """safetensors' "Error while deserializing header" came with a traceback naming no file."""
    import shutil

    target = tmp_path / "m3"
    shutil.copytree(tiny_target, target)
    (target / "model.safetensors").write_bytes(content)
    out = tmp_path / "draft"
    capsys.readouterr()
    assert main(["tiny-draft", str(target), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"sglang-m3 tiny-draft: {target / 'model.safetensors'}: not a readable safetensors file (")
    assert err.count("\n") == 1
    assert not out.exists()


def _run_in_a_fresh_process(argv, cwd):
    """(status, whether torch was imported, stderr) of ``sglang-m3 ARGV`` run in ``cwd``."""
    probe = f"import sys; from sglang_m3.cli import main; status = main({argv!r}); print(status, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=cwd)
    status, imported = done.stdout.split()
    return int(status), imported == "True", done.stderr


@pytest.mark.parametrize("command", [["tiny-checkpoint"], ["tiny-draft", "/nonexistent-m3-target"]])
def test_an_empty_output_path_is_refused_before_the_build(command, tmp_path):
    """``''`` had the whole checkpoint staged next to the working directory's parent, then failed
    with ``cannot write : No such file or directory (<staging dir>)``."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    status, imported, err = _run_in_a_fresh_process([*command, ""], cwd)
    assert (status, imported) == (1, False), err
    assert err == f"sglang-m3 {command[0]}: the output directory is an empty path ('')\n"
    assert [p.name for p in tmp_path.rglob("*")] == ["cwd"]


def test_a_dangling_symlink_as_the_output_is_refused_before_the_build(tmp_path):
    """It was built first, then refused naming a staging file (``.tiny-m3-.../tokenizer.json``)."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    status, imported, err = _run_in_a_fresh_process(["tiny-checkpoint", str(link)], tmp_path)
    assert (status, imported) == (1, False), err
    assert err == (f"sglang-m3 tiny-checkpoint: the output directory {link} is a symbolic link to "
                   f"{tmp_path / 'nowhere'}, which does not exist\n")
    assert [p.name for p in tmp_path.iterdir()] == ["dangling"]


def test_ctrl_c_during_the_build_leaves_nothing_and_no_traceback(tmp_path):
    """Interrupted once its staging directory exists (mid-build), the command printed a
    KeyboardInterrupt traceback; it says it was interrupted, exits 130 and takes the staging back."""
    build = subprocess.Popen([sys.executable, "-m", "sglang_m3.cli", "tiny-checkpoint", str(tmp_path / "out")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not any(tmp_path.iterdir()) and build.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [p.name.startswith(".tiny-m3-") for p in tmp_path.iterdir()] == [True]
    build.send_signal(signal.SIGINT)
    out, err = build.communicate(timeout=300)
    assert (build.returncode, out) == (130, "")
    assert err.endswith("sglang-m3 tiny-checkpoint: interrupted\n") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []

"""``scripts/gpu/run.sh pack``: what a device call leaves under $OUT comes back whole.

The device hands back at most eight files, none named with '=' or ',' (the tuner's tables are);
one session lost a tuned table and a result file that way. ``pack`` needs no GPU and no harness.
"""

import os
import subprocess
import tarfile

RUN_SH = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu", "run.sh")


def pack(out, *keep):
    env = {**os.environ, "OUT": str(out), "M3_SITE_ARCHIVE": "/nonexistent"}
    done = subprocess.run(["bash", RUN_SH, "pack", *keep], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def members(out):
    with tarfile.open(out / "out.tar") as archive:
        return {m.name.removeprefix("./") for m in archive.getmembers() if m.isfile()}


def test_pack_archives_everything_and_keeps_only_the_named_files(tmp_path):
    (tmp_path / "tune" / "deep").mkdir(parents=True)
    (tmp_path / "tune" / "E=64,N=3072,device_name=H100.json").write_text("{}")
    (tmp_path / "tune" / "deep" / "report.json").write_text("{}")
    (tmp_path / "bench.log").write_text("ttft")
    (tmp_path / "e2e.json").write_text("{}")
    printed = pack(tmp_path, "e2e.json")
    assert members(tmp_path) == {"tune/E=64,N=3072,device_name=H100.json", "tune/deep/report.json", "bench.log", "e2e.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2e.json", "out.tar"]
    assert "4 files" in printed and "e2e.json" in printed


def test_packing_twice_keeps_the_first_pack(tmp_path):
    (tmp_path / "first.log").write_text("1")
    pack(tmp_path)
    (tmp_path / "second.log").write_text("2")
    pack(tmp_path)
    assert members(tmp_path) == {"first.log", "second.log"}
    assert [p.name for p in tmp_path.iterdir()] == ["out.tar"]


def test_a_file_too_large_to_come_back_stays_out_of_the_archive(tmp_path):
    """A tuning call's kernel-cache archive once outgrew the device's 16 MiB per returned file;
    packed with the results it took them all down. Over the limit (here 1 MiB) a file stays out,
    named, and the rest still comes back."""
    (tmp_path / "gpu-caches.tar.xz").write_bytes(b"\0" * (2 * 1024 * 1024))
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "report.json").write_text("{}")
    env = {**os.environ, "OUT": str(tmp_path), "M3_SITE_ARCHIVE": "/nonexistent", "M3_PACK_MAX_MB": "1"}
    done = subprocess.run(["bash", RUN_SH, "pack", "gpu-caches.tar.xz"], env=env, capture_output=True, text=True, check=True)
    assert members(tmp_path) == {"tune/report.json"}
    assert "left out of out.tar (over 1 MiB): gpu-caches.tar.xz" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-caches.tar.xz", "out.tar"]


def caches(out, jit, triton):
    env = {**os.environ, "OUT": str(out), "M3_SITE_ARCHIVE": "/nonexistent",
           "SGLANG_JIT_CACHE_DIR": str(jit), "TRITON_CACHE_DIR": str(triton)}
    return subprocess.run(["bash", RUN_SH, "caches"], env=env, capture_output=True, text=True)


def test_caches_hands_back_both_kernel_caches_in_one_archive(tmp_path):
    """A later call on a fresh machine carries them instead of compiling again."""
    out, jit, triton = tmp_path / "out", tmp_path / "build" / "jit-cache", tmp_path / "build" / "triton-cache"
    (jit / "sm90a" / "rope").mkdir(parents=True)
    (jit / "sm90a" / "rope" / "rope.so").write_bytes(b"\x7fELF")
    (triton / "ABC123").mkdir(parents=True)
    (triton / "ABC123" / "__grp__kernel.json").write_text("{}")
    done = caches(out, jit, triton)
    assert done.returncode == 0, done.stderr
    assert "gpu-caches.tar.xz" in done.stdout
    with tarfile.open(out / "gpu-caches.tar.xz") as archive:
        names = {m.name for m in archive.getmembers() if m.isfile()}
    assert names == {"jit-cache/sm90a/rope/rope.so", "triton-cache/ABC123/__grp__kernel.json"}


def test_caches_says_so_when_no_kernel_was_compiled_yet(tmp_path):
    done = caches(tmp_path / "out", tmp_path / "none-jit", tmp_path / "none-triton")
    assert done.returncode == 2
    assert "no kernel cache" in done.stderr and "none-triton" in done.stderr
    assert not (tmp_path / "out" / "gpu-caches.tar.xz").exists()

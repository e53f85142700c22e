"""The model plugin stays active when SGLANG_PLATFORM selects a platform that is not ours.

SGLang 0.5.23 skips the general plugins of every distribution that declares an unselected
platform (``sglang.srt.plugins._get_excluded_dists``). These tests install, on PYTHONPATH, a fake
distribution that stands in for another vendor's platform, select it, and check with SGLang's own
discovery (and once with the real server) that the project's M3 classes and hooks are still in use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distribution, entry_points, version
from pathlib import Path

import pytest
import requests
from server_harness import launch_cpu_server

from sglang_m3.integration.hooks import M3_ARCHITECTURES
from sglang_m3.plugin import HOOKS

STANDIN_PLATFORM = "standin"

# Another platform, for the test's purposes: the project's CPU platform under another name, so it
# can also serve; a subclass that marks the log, so the server log shows this platform was used.
STANDIN_MODULE = '''\
import sys

from sglang_m3.platform.cpu_platform import TorchNativeCpuPlatform

STARTED = "standin platform started"


class StandinPlatform(TorchNativeCpuPlatform):
    """Stands in for a platform of another distribution, and says so in the server log."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print(STARTED, file=sys.stderr, flush=True)


def activate():
    return "standin_platform.StandinPlatform"
'''

# The layout this project had before: one distribution declaring its platform and its plugin.
OLD_LAYOUT = "sglang-m3-old-layout"

# Runs in a fresh interpreter (SGLang's plugin loading is once per process) and prints JSON.
DISCOVERY_SCRIPT = '''\
import json
from sglang.srt.plugins import _get_excluded_dists, load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

load_plugins()
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.platforms import current_platform

print(json.dumps({
    "excluded": sorted(_get_excluded_dists()),
    "platform": type(current_platform).__qualname__,
    "models": {arch: ModelRegistry.models[arch].__module__ for arch in %r},
    "hooks": {
        target: [[kind.name, fn.__module__ + "." + fn.__qualname__, src.dist_name if src else None]
                 for kind, fn, src in registered]
        for target, registered in HookRegistry._hooks.items()
    },
    "patched": sorted(HookRegistry._patched),
}))
''' % (M3_ARCHITECTURES,)


def write_distribution(site: Path, name: str, entry_points_txt: str, modules: dict[str, str] | None = None) -> None:
    """Install a distribution the way pip leaves one: a dist-info folder (plus modules) on a path entry."""
    dist_info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(entry_points_txt)
    for module, source in (modules or {}).items():
        (site / f"{module}.py").write_text(source)


@pytest.fixture
def standin_site(tmp_path) -> Path:
    site = tmp_path / "site"
    write_distribution(
        site, "standin-platform",
        f"[sglang.srt.platforms]\n{STANDIN_PLATFORM} = standin_platform:activate\n",
        {"standin_platform": STANDIN_MODULE},
    )
    return site


def env_with(site: Path) -> dict[str, str]:
    """The environment that selects the stand-in platform, with ``site`` importable."""
    return {
        "SGLANG_PLATFORM": STANDIN_PLATFORM,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }


def test_the_project_declares_its_platform_from_a_separate_distribution():
    platforms = {ep.name: ep for ep in entry_points(group="sglang.srt.platforms")}
    assert platforms["sglang_m3_cpu"].dist.name == "sglang-m3-cpu-platform"
    assert platforms["sglang_m3_cpu"].value == "sglang_m3.platform:activate"
    assert not distribution("sglang-m3").entry_points.select(group="sglang.srt.platforms")


def test_sglang_discovery_keeps_the_plugin_under_another_platform(standin_site):
    # Negative control: the old single-distribution layout, declared beside the real one.
    write_distribution(
        standin_site, OLD_LAYOUT,
        "[sglang.srt.platforms]\nold_layout_cpu = sglang_m3.platform:activate\n\n"
        "[sglang.srt.plugins]\nold_layout = sglang_m3.plugin:register\n",
    )
    env = {key: value for key, value in os.environ.items()
           if key not in ("SGLANG_EXTERNAL_MODEL_PACKAGE", "SGLANG_PLUGINS")}  # both would mask a lost plugin
    run = subprocess.run([sys.executable, "-c", DISCOVERY_SCRIPT], capture_output=True, text=True,
                         env={**env, **env_with(standin_site)}, timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])

    assert found["platform"] == "StandinPlatform"
    # The mechanism: every distribution with an unselected platform is excluded, the old layout
    # included, and none of its hooks were registered; the plugin's own distribution is not.
    assert {OLD_LAYOUT, "sglang-m3-cpu-platform"} <= set(found["excluded"])
    assert "sglang-m3" not in found["excluded"]
    sources = {source for registered in found["hooks"].values() for *_, source in registered}
    assert OLD_LAYOUT not in sources
    # The outcome: the project's classes serve M3, and every hook is registered and applied.
    assert all(module.startswith("sglang_m3.") for module in found["models"].values()), found["models"]
    for hook in HOOKS:
        function = f"{hook.function.__module__}.{hook.function.__qualname__}"
        assert [hook.kind, function, "sglang-m3"] in found["hooks"].get(hook.target, []), hook.target
        assert hook.target in found["patched"]


@pytest.mark.server
def test_server_under_another_platform_serves_the_project_classes(standin_site, tiny_m3_checkpoint, server_log_dir):
    # Cold: plugin discovery in fresh interpreters (the launcher and the processes SGLang spawns) is
    # what this checks, and a forked server would inherit it.
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, env=env_with(standin_site), cold=True) as server:
        reply = requests.post(f"{server.base_url}/generate", timeout=900, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        })
        assert reply.status_code == 200, reply.text
        assert reply.json()["meta_info"]["completion_tokens"] >= 1
        log = Path(server.log_path).read_text(encoding="utf-8", errors="replace")
    assert "standin platform started" in log, "SGLang did not use the stand-in platform"
    expected = f"sglang-m3 {version('sglang-m3')} serves MiniMaxM3SparseForCausalLM (sglang_m3.models.minimax_m3)"
    assert expected in log, log[-4000:]

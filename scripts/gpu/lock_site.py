"""Write ``site.lock``: exact versions of the wheels the device archive carries.

The closure is read from a working SGLang 0.5.23 environment (the project's CPU ``.venv``, where
SGLang serves and the test suite passes), not from a fresh PyPI resolution: those versions are
known to work together, and resolving SGLang's CUDA-heavy metadata against PyPI for another
interpreter backtracks through gigabytes of torch/triton wheels. Starting from the names in
``site.in``, every ``Requires-Dist`` is followed (markers evaluated for CPython 3.12 on Linux
x86_64, extras ignored); a package is carried unless the device image already has it
(``device_provided.txt``) or it is part of the CUDA stack the device brings (``EXCLUDED``).

Usage: .venv/bin/python scripts/gpu/lock_site.py   (build_site.sh --relock runs it)
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
DEVICE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
# The device's own torch/triton/CUDA stack, and SGLang's compiled kernel wheels (the harness
# stands in for sgl_kernel: see standins/). Never carried, whatever requires them.
EXCLUDED = re.compile(r"^(torch|triton|nvidia-.*|sgl-.*|sglang-kernel|flashinfer.*|flash-attn.*|cuda-.*|cupy.*|"
                      r"tilelang|quack-kernels|humming-kernels|torch-memory-saver|torchaudio|torchvision|torchcodec|"
                      r"nvshmem4py.*|sglang)$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names_in(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def closure(top: list[str], provided: set[str]) -> dict[str, str]:
    """Name -> installed version for everything reachable from ``top`` that the device lacks."""
    carried: dict[str, str] = {}
    queue = [Requirement(line) for line in top]
    forced = {normalize(r.name) for r in queue}
    while queue:
        req = queue.pop()
        name = normalize(req.name)
        if name in carried or EXCLUDED.match(name) or (name in provided and name not in forced):
            continue
        if req.marker is not None and not req.marker.evaluate(DEVICE_ENV):
            continue
        dist = md.distribution(req.name)
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"{req} is not satisfied by the reference environment ({dist.version})")
        carried[name] = dist.version
        for text in dist.requires or []:
            dep = Requirement(text)
            if dep.marker is not None and "extra" in str(dep.marker):
                continue
            queue.append(dep)
    return carried


def main() -> None:
    provided = {normalize(re.split(r"[=<>]", line)[0]) for line in names_in(HERE / "device_provided.txt")}
    carried = closure(names_in(HERE / "site.in"), provided)
    lines = ["# Written by scripts/gpu/lock_site.py (from site.in, device_provided.txt and the reference .venv).",
             "# The wheels build_site.sh carries to the device, CPython 3.12 manylinux x86_64; sglang comes on top."]
    lines += [f"{name}=={version}" for name, version in sorted(carried.items())]
    (HERE / "site.lock").write_text("\n".join(lines) + "\n")
    print(f"site.lock: {len(carried)} packages")


if __name__ == "__main__":
    main()

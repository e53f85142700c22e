"""GPU-harness stand-in for PyAV (test infrastructure only).

The project's video preprocessing imports ``av`` at module level, so the plugin cannot register
without it; the real wheel (bundled FFmpeg, tens of MB) does not fit the device call beside the
site archive, and the GPU runs decode no video. Any use raises, naming this stand-in.
"""

__version__ = "0.0.0.standin"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotImplementedError(
        f"av.{name}: PyAV is a stand-in in the GPU harness (scripts/gpu/standins/av); video decoding is not available there"
    )

"""Which UCX the package loads: the wheel's, preloaded at import, unless the extension was
built against a UCX of one's own (TDX_UCX_HOME), which the preload would shadow: both
libraries are libucp.so.0, and the loader reuses one already loaded under that name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent("""
    import sys, types
    calls = []
    fake = types.ModuleType("libucx")
    def load_library():  # records the call, then loads the wheel's UCX as usual
        calls.append(1)
        sys.modules["libucx_real"].load_library()
    fake.load_library = load_library
    sys.modules["libucx"] = fake
    info = types.ModuleType("torchdist_ext._build_info")
    info.UCX_HOME = {home!r}
    sys.modules["torchdist_ext._build_info"] = info
    import torchdist_ext
    print("preloaded" if calls else "not preloaded", torchdist_ext.ucx_version())
""")


@pytest.mark.parametrize("home, want", [(None, "preloaded"), ("/opt/ucx", "not preloaded")])
def test_the_wheels_ucx_is_preloaded_only_for_builds_against_it(home, want) -> None:
    # The real wheel stays importable under another name, so the preload still works
    # when it happens (the extension needs a libucp.so.0 either way).
    setup = ("import importlib, sys; sys.modules['libucx_real'] = importlib.import_module"
             "('libucx'); del sys.modules['libucx']\n")
    out = subprocess.run([sys.executable, "-c", setup + _PROBE.format(home=home)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0:len(want.split())] == want.split(), out.stdout

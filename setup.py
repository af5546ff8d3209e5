"""Build the torchdist_ext._C extension against the installed torch and UCX.

UCX comes from the libucx-cu13 wheel unless TDX_UCX_HOME points at a UCX install
(needed for InfiniBand/RoCE: the wheel is built without verbs). CUDA sources (*.cu) are
compiled when nvcc and a CUDA build of torch are present and TDX_WITH_CUDA is not 0.
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

# torch guesses CUDA_HOME from the directory above `nvcc` on PATH; when `nvcc` is a
# wrapper script or a symlink (/usr/local/bin/nvcc) that guess has no headers. Take the
# first candidate that has them.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
    _nvcc = shutil.which("nvcc")
    _candidates = [os.path.dirname(os.path.dirname(os.path.realpath(_nvcc)))] if _nvcc else []
    _candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for _home in _candidates:
        if os.path.exists(os.path.join(_home, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = _home
            break

import torch  # noqa: E402  (after CUDA_HOME: cpp_extension reads it at import)
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def ucx_paths():
    home = os.environ.get("TDX_UCX_HOME")
    if home:
        return os.path.join(home, "include"), os.path.join(home, "lib"), [os.path.join(home, "lib")]
    import libucx  # the libucx-cu13 wheel

    base = os.path.dirname(libucx.__file__)
    lib = os.path.join(base, "lib")
    # $ORIGIN/../libucx/lib finds the wheel next to an installed torchdist_ext; the
    # absolute path covers in-place (editable) builds.
    return os.path.join(base, "include"), lib, ["$ORIGIN/../libucx/lib", lib]


def sources(pattern):
    return sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True)
    )


ucx_include, ucx_lib, rpaths = ucx_paths()
# The package preloads the wheel's UCX at import, which would take the place of a UCX of
# one's own (both are libucp.so.0): it needs to know which one the build linked. Written
# only when it changes, and a dependency of the extension, so that switching UCX relinks
# the extension instead of leaving it linked to the other one.
BUILD_INFO = os.path.join("torchdist_ext", "_build_info.py")
_info = ('"""Written by setup.py: how this build of the extension was made."""\n\n'
         f"UCX_HOME = {os.environ.get('TDX_UCX_HOME') or None!r}\n")
_path = os.path.join(ROOT, BUILD_INFO)
if not os.path.exists(_path) or open(_path).read() != _info:
    with open(_path, "w") as _f:
        _f.write(_info)
cpp_sources = sources("*.cpp")
cu_sources = sources("*.cu")
with_cuda = (
    os.environ.get("TDX_WITH_CUDA", "1") != "0"
    and torch.version.cuda is not None
    and CUDA_HOME is not None
    and bool(cu_sources)
)
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

common = dict(
    include_dirs=[os.path.join(ROOT, "csrc"), ucx_include],
    library_dirs=[ucx_lib],
    libraries=["ucp", "ucs"],
    extra_link_args=[f"-Wl,-rpath,{p}" for p in rpaths],
    depends=[BUILD_INFO],
)
cxx_flags = ["-O3", "-Wall", "-Wno-unused-parameter"]
if with_cuda:
    ext = CUDAExtension(
        "torchdist_ext._C",
        cpp_sources + cu_sources,
        extra_compile_args={"cxx": cxx_flags + ["-DTDX_WITH_CUDA"], "nvcc": ["-O3", "-DTDX_WITH_CUDA"]},
        **common,
    )
else:
    ext = CppExtension("torchdist_ext._C", cpp_sources, extra_compile_args={"cxx": cxx_flags}, **common)

setup(
    packages=find_packages(include=["torchdist_ext", "torchdist_ext.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

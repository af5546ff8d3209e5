import os
import tempfile

# Before anything imports torchdist_ext (which loads the host's calibration file): the
# tests expect the backend's default cost model, not whatever `bench calibrate` or `bench
# tune` saved on this machine. A file in a directory that does not exist (nothing is left
# behind); tests that want a file point TDX_CALIBRATION at theirs. Spawned ranks inherit
# it.
os.environ["TDX_CALIBRATION"] = os.path.join(tempfile.gettempdir(),
                                             f"tdx-tests-{os.getpid()}-none",
                                             "no-calibration.json")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)

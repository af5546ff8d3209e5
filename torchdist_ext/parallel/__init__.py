"""Training strategies over any process group, tdx's first.

- :class:`ZeroOptimizer` (ZeRO stages 1 and 2): optimizer state, and in stage 2 gradients,
  sharded across the ranks, over flat buffers laid out by the C++ core
  (``csrc/parallel/``).
"""

from .zero import ZeroConfig, ZeroOptimizer

__all__ = ["ZeroConfig", "ZeroOptimizer"]

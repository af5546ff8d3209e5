"""Training strategies over any process group, tdx's first.

- :class:`ZeroOptimizer` (ZeRO stages 1, 2 and 3): optimizer state, in stage 2 gradients
  too, and in stage 3 parameters as well (gathered unit by unit as the model runs),
  sharded across the ranks, over flat buffers laid out by the C++ core
  (``csrc/parallel/``).
- :class:`PipelineStage` (pipeline parallelism, GPipe and 1F1B, and PipeDream and 2BW,
  which update the weights during the step): one stage per rank, running the action list
  of a :class:`Schedule` that the C++ core makes and checks, on the weight versions it
  plans.
- :class:`ParameterServer` (sync and async, with bounded staleness): parameters and
  optimizer on the group's first ranks, gradients pushed by the others; the C++ core
  decides when an async worker may go on.
"""

from .parameter_server import ParameterServer, ServeReport, ServerConfig, Update
from .pipeline import PipelineConfig, PipelineStage, Schedule
from .zero import ZeroConfig, ZeroOptimizer

__all__ = ["ParameterServer", "PipelineConfig", "PipelineStage", "Schedule", "ServeReport",
           "ServerConfig", "Update", "ZeroConfig", "ZeroOptimizer"]

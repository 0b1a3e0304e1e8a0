"""The decode kernels and the decode steps built on them: a layer above the model (whose modules the steps read)
and below the inference engine (which picks a step per device).

* ``decode_kernels.c`` / ``decode_kernels``: the CPU kernels (GEMVs of fp32, bf16 and FP8 weights, the router,
  the routed and shared experts, the absorbed attention, RMSNorm, the logits scan, a whole block and a whole
  step), compiled with the system C compiler at first use and cached;
* ``ops``: those kernels as ``torch.library`` custom ops (``torch.ops.dsv3.*``), each with its PyTorch
  reference as the fallback, so that a step over them runs eagerly or compiled, with or without the C build;
* ``decode``: ``FastDecode``, the engine's CPU decode step; ``static_decode``: ``StaticDecode``, the
  static-shape step that ``torch.compile`` and CUDA graphs take.

The model (``dsv3.model``) knows nothing of this layer (a ``lint-imports`` contract in pyproject.toml).
"""

from dsv3.kernels import int_weights, ops  # registers torch.ops.dsv3.* (the decode steps call them)

__all__ = ["int_weights", "ops"]

"""The fast paths: the decode kernels and the decode steps built on them, and the CUDA FP8 GEMM; a layer above the
model (whose modules the steps read) and below the inference engine (which picks a step per device).

* ``decode_kernels.c`` / ``decode_kernels``: the CPU kernels (GEMVs of fp32, bf16 and FP8 weights, the router,
  the routed and shared experts, the absorbed attention, RMSNorm, the logits scan, a whole block and a whole
  step), compiled with the system C compiler at first use and cached;
* ``ops``: those kernels as ``torch.library`` custom ops (``torch.ops.dsv3.*``), each with its PyTorch
  reference as the fallback, so that a step over them runs eagerly or compiled, with or without the C build;
* ``fp8_gemm`` (with ``fp8_triton``): the CUDA kernels of ``torch.ops.dsv3.fp8_blockwise_mm``, the FP8
  training GEMM that ``dsv3.precision.fp8`` defines with its PyTorch reference (cuBLAS blockwise and our Triton
  kernel), registered on import: a process that runs FP8 GEMMs on a GPU imports this package;
* ``decode``: ``FastDecode``, the engine's CPU decode step; ``static_decode``: ``StaticDecode``, the
  static-shape step that ``torch.compile`` and CUDA graphs take.

The model (``dsv3.model``) knows nothing of this layer (a ``lint-imports`` contract in pyproject.toml).
"""

from dsv3.kernels import fp8_gemm, int_weights, ops  # registers the kernels of torch.ops.dsv3.*

__all__ = ["fp8_gemm", "int_weights", "ops"]

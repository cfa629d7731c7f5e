"""The fast rollout engine (static KV cache, CUDA-graph decode, humming 4-bit GEMMs, batched
LoRA), split by concern: :mod:`.plan` (what is read from the model), :mod:`.gemm` (the group
GEMMs), :mod:`.torch_forward` (prefill / CPU path), :mod:`.kernels` and :mod:`.decode` (the
Triton decode step), :mod:`.sampling`, :mod:`.state` and :mod:`.engine` (``FastEngine``)."""

from qerl.rollout.fast.engine import FastEngine, FastRolloutEngine
from qerl.rollout.fast.plan import build_plan
from qerl.rollout.fast.sampling import sample_tokens

__all__ = ["FastEngine", "FastRolloutEngine", "build_plan", "sample_tokens"]

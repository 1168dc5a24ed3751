"""How the model is spread over the ranks (``--parallelism``): a whole copy on every rank,
its gradients all-reduced (DDP, the default), or sharded with FSDP2's ``fully_shard``, built
on the meta device and materialized shard by shard so that no rank ever holds the whole model.

``build.py`` builds a task's parts either way; ``wrap.py`` is the loop's side: the wrapper the
step runs through, the micro-batches' gradient sync, and clipping the global gradient's norm.
"""

from training.loop.parallel.build import build_parts
from training.loop.parallel.wrap import (
    clip_grad_norm,
    clip_to_norm,
    compile_model,
    gradient_norm,
    gradient_sync,
    reshard,
    wrap_model,
)

__all__ = [
    "build_parts",
    "clip_grad_norm",
    "clip_to_norm",
    "compile_model",
    "gradient_norm",
    "gradient_sync",
    "reshard",
    "wrap_model",
]

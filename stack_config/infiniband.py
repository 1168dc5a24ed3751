"""The ``rdma`` key: InfiniBand between the GPU nodes, where the size has it.

``auto`` turns it on for the sizes whose catalogue entry has InfiniBand (``catalog/gpu_sizes.py``,
the ND sizes) and off elsewhere; ``on`` is refused for a size without it rather than ignored.
"""

from __future__ import annotations

from catalog import gpu_sizes
from stack_config.keys import RDMA_MODES
from stack_config.model import LabConfig


def rdma_problems(cfg: LabConfig) -> list[str]:
    """``rdma`` is one of ``RDMA_MODES``, and ``on`` only for a size with InfiniBand."""
    if cfg.rdma not in RDMA_MODES:
        return [f"{cfg.key('rdma')} must be one of {', '.join(RDMA_MODES)}; got {cfg.rdma!r}"]
    size = gpu_sizes.gpu_size(cfg.gpu_pool.vm_size)
    if cfg.rdma == "on" and size is not None and size.infiniband is None:
        with_ib = ", ".join(s.name for s in gpu_sizes.SIZES if s.infiniband)
        return [
            f"{cfg.key('rdma')} on: {size.name} has no InfiniBand (sizes with it: {with_ib}); "
            "use auto or off"
        ]
    return []

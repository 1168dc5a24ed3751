"""Check whether the GPU size has InfiniBand, and whether the region offers it with the size.

The catalogue says which sizes have it (``catalog/gpu_sizes.py``, the ND sizes); the region's
Resource SKUs say whether the size there is RDMA-enabled (the ``RdmaEnabled`` capability,
"True" for the InfiniBand sizes, in Resource Skus - List, Microsoft.Compute). Read after the VM
size check, which fetched the size's SKU (``ctx.skus``).
"""

from __future__ import annotations

from collections.abc import Iterator

from catalog import gpu_sizes
from lab.azure.preflight.context import FAILS, OK, Check, Context

NAME = "InfiniBand"
RDMA_CAPABILITY = "RdmaEnabled"


def check_infiniband(ctx: Context) -> Iterator[Check]:
    cfg, region = ctx.cfg, ctx.cfg.location
    size = gpu_sizes.gpu_size(cfg.gpu_pool.vm_size)
    ib = size.infiniband if size else None
    if size is None or ib is None:
        yield Check(NAME, OK, f"{cfg.gpu_pool.vm_size} has none: NCCL uses TCP over Ethernet")
        return
    has = f"{size.name} has {ib.links} × {ib.gbps} Gb/s"
    if cfg.rdma == "off":
        yield Check(NAME, OK, f"{has}; off ({cfg.key('rdma')}): NCCL uses TCP over Ethernet")
        return
    sku = ctx.skus.get(size.name.lower())
    if sku is None:  # the VM size check already failed the size
        yield Check(NAME, FAILS, f"{has}, but {region} does not offer the size")
        return
    capabilities = {c.name: c.value for c in sku.capabilities or []}
    if capabilities.get(RDMA_CAPABILITY) != "True":
        fix = f"a region whose {size.name} is RDMA-enabled, or {cfg.key('rdma')} off"
        detail = f"{has}, but {region} does not list it {RDMA_CAPABILITY}"
        yield Check(NAME, FAILS, detail, fix)
        return
    yield Check(NAME, OK, f"{has}; {region} offers it ({RDMA_CAPABILITY}); the workers use it")

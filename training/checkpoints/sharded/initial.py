"""A sharded model's weights from another run's checkpoint (``--init-from``), each rank holding
in memory only its own shards, never the whole model: ``dcp.load`` of the model's entries alone
into this model's DTensors, resharded from the world it was saved at
(``ShardedCheckpoints.load``: each rank downloads and verifies only the files its shards read).
``DoesNotFit`` when the source's model is not this one's (names, shapes).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from training.checkpoints.checkpoint import Entry
from training.checkpoints.sharded.repository import (
    DoesNotFitState,
    ShardedCheckpoints,
)
from training.checkpoints.storage import ObjectStore

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
"""Where a checkpoint keeps the model: ``ModelState`` under ``model``, with the weights under
its own ``model``."""


class DoesNotFit(ValueError):
    """The source's model is not this one's: the message names the first difference."""


def load_sharded_source(
    store: ObjectStore, scratch: Path, model: nn.Module, group: Any
) -> Entry | None:
    """The newest sharded checkpoint in ``store`` that verifies, its model only, into
    ``model``'s shards; its entry, or None when none verifies. Every rank calls this."""
    weights = get_model_state_dict(model)  # the DTensors DCP loads into, in place
    wanted = {MODEL_KEY: {MODEL_KEY: weights}}
    try:
        entry = ShardedCheckpoints(store, scratch).load(wanted, group=group)
    except DoesNotFitState as exc:
        raise DoesNotFit(exc.detail) from None
    if entry is not None:
        set_model_state_dict(model, weights)
    return entry

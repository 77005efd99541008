"""What libraries set up when a model is constructed, done again for a replica, which is unpickled.

A worker's replica is unpickled, not constructed: the ``__init__`` of its classes never ran in the worker.
Where a library records process-wide state there, the model computes something else in the worker than in
one process (or in DataParallel's replicas, which live in that process), so :func:`prepare` does for the
replica what ``__init__`` did in the coordinator:

* HF transformers (5.x) records in ``PreTrainedModel.__init__`` which of a model class's outputs its hooks
  can capture (``_CAN_RECORD_REGISTRY``, keyed on the class). A model class never constructed in the worker
  had no entry there, and its replica silently returned no ``hidden_states`` and no ``attentions`` when
  asked for them (``output_hidden_states=True``). The entry is stored under the key ``__init__`` uses, the
  class's name: 5.24's registry turns a model into it, 5.17's is a plain dict (checked with both).

Nothing is imported here: a library the model uses was imported by unpickling it.
"""
from __future__ import annotations

import sys

import torch

__all__ = ["prepare"]


def prepare(model: torch.nn.Module) -> None:
    """Redo, for the replica ``model``, the process-wide set-up its classes' ``__init__`` does."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    modeling = sys.modules.get("transformers.modeling_utils")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if registry is None or not isinstance(pretrained, type):
        return
    for m in model.modules():
        key = str(m.__class__)  # what __init__ stores under (a plain dict in 5.17; 5.24's maps a model to it)
        if isinstance(m, pretrained) and key not in registry:
            dict.__setitem__(registry, key, m._can_record_outputs)

"""dpool inside the trainers people use; each module imports its library only when it is imported.

* :mod:`dpool.integrations.transformers`: ``DpoolTrainer``, ``DpoolTrainerMixin`` (HF Trainer)
* :mod:`dpool.integrations.lightning`: ``DpoolStrategy`` (Lightning's Trainer and Fabric)

accelerate needs no module of its own: a dpool model goes through ``prepare()`` in one process, and the
DistributedDataParallel that a multi-process run would put around it is refused by the model itself
(``dpool.wrapper.DataParallel._ddp_params_and_buffers_to_ignore``).
"""


def require(library: str, version: str, floor: tuple[int, int]) -> None:
    """Refuse a ``library`` older than ``floor`` (its oldest version the integration tests pass with, as in
    ``pyproject.toml``; ``scripts/test-floors.sh`` runs them): older ones failed them, and a run on one could be
    silently wrong. An ``ImportError``, as a library raises for a dependency too old."""
    have = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if have < floor:
        raise ImportError(f"dpool's {library} integration needs {library}>={floor[0]}.{floor[1]}, the oldest version "
                          f"its tests pass with; this environment has {library} {version}. Run "
                          f"pip install '{library}>={floor[0]}.{floor[1]}' (or: pip install 'dpool[{library}]')")

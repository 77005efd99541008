"""dpool inside the trainers people use; each module imports its library only when it is imported.

* :mod:`dpool.integrations.transformers`: ``DpoolTrainer``, ``DpoolTrainerMixin`` (HF Trainer)
* :mod:`dpool.integrations.lightning`: ``DpoolStrategy`` (Lightning's Trainer and Fabric)
* :mod:`dpool.integrations.accelerate`: the check that refuses DDP around a dpool model
"""

"""dpool inside the trainers people use; each module imports its library only when it is imported.

* :mod:`dpool.integrations.transformers`: ``DpoolTrainer``, ``DpoolTrainerMixin`` (HF Trainer)
* :mod:`dpool.integrations.lightning`: ``DpoolStrategy`` (Lightning's Trainer and Fabric)

accelerate needs no module of its own: a dpool model goes through ``prepare()`` in one process, and the
DistributedDataParallel that a multi-process run would put around it is refused by the model itself
(``dpool.wrapper.DataParallel._ddp_params_and_buffers_to_ignore``).
"""

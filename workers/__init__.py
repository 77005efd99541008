"""dpool's worker-side runtime: installed as ``dpool_workers``: the worker process (``dpool_workers.worker``), its replica (``dpool_workers.replica``) and the ``dpool-workers`` daemon."""

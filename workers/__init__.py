"""dpool's worker-side runtime: the worker process (``workers.worker``) and its replica (``workers.replica``)."""

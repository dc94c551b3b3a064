"""Planning: from a model to the plan it trains with, one pipeline for every entry point.

* ``keys.py`` — the one machine key and the cache keys built on it;
* ``cache.py`` — the on-disk cache and the checks every entry passes before it is used;
* ``offline.py`` — the shared search stages, and ``autodist plan``/``timeline``'s pipeline
  (:func:`~autodist.planner.offline.plan_offline`);
* ``check.py`` — ``autodist check``'s pipeline: the simulator's measured error, stored per machine;
* ``online.py`` — ``plan="auto"`` (:class:`~autodist.planner.online.AutoPlanner`), through the narrow
  ``Runtime`` view the wrapper hands it; ``recorder.py`` — its transparent profiling;
* ``estimator.py`` — the switch behind which the learned estimator (``autodist/lab``) is consulted.
"""

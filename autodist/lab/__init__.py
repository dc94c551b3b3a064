"""Research code off the training path: the learned estimator (``learned.py``), the step tracer it
trains on (``steptrace.py``) and the tools' fidelity analyses (``fidelity.py``).

Only ``tools/`` import it, and ``autodist/planner`` behind its switch: ``plan="auto"`` reads the
learned estimator only where one is stored for the machine (``autodist/planner/estimator.py``).
"""

"""Measuring: model profiles, the comm sweep, the runtime's own overheads (modelling is in ``cost/``)."""

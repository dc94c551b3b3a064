"""Comm model and its sweep, memory rules, budget, simulator, learned estimator."""

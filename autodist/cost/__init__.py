"""Modelling: the comm model, memory rules, budget, interconnects, the simulator and its measured error."""

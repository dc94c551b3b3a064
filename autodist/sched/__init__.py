"""Plan space and moves, seeds and greedy passes, backtracking search."""

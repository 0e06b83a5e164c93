"""Benchmarks (`make bench`, `tensorpar bench`): tensorpar side by side with its baselines.

Every comparison runs in one launch with interleaved repeats and reports medians and ratios:
this machine is shared and noisy, so an absolute time means little, a ratio measured in the same
minute means more. Tests check behaviour, never these timings.
"""

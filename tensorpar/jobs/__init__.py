"""The jobs behind `tensorpar run` and `tensorpar verify`: library functions returning reports.

They launch the ranks, shard a real checkpoint, compare against the unsplit model and the
planner's prediction, and return dataclasses; the CLI prints them.
"""

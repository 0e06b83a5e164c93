"""tensorpar.sharding: plans and their application, from a model's declaration to its proof.

- :mod:`.registry`: what tensorpar knows about each architecture (plain data);
- :mod:`.plan`: patterns, sizes and the typed records passed between the steps;
- :mod:`.styles`: every style a plan can name, with its builder;
- :mod:`.declared`: transformers' declared styles in tensorpar's;
- :mod:`.resolve` -> :mod:`.feasibility` / :mod:`.checks` -> :mod:`.styles` (build) ->
  :mod:`.commit` -> :mod:`.prove`: the steps of ``parallelize`` (:mod:`.apply`);
- :mod:`.discover`: checked column -> row pairs of a model nothing declares.

Importing this package loads nothing heavy; ``parallelize`` is ``tensorpar.parallelize``.
"""

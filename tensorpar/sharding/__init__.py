"""tensorpar.sharding: plans and their application, from a model's declaration to its proof.

- :mod:`.registry`: what tensorpar knows about each architecture (plain data);
- :mod:`.plan`: patterns, sizes and the typed records passed between the steps;
- :mod:`.styles`: every style a plan can name, with its builder (:mod:`.param_styles`: those
  that split one parameter of a module that stays);
- :mod:`.declared`: transformers' declared styles in tensorpar's;
- :mod:`.resolve` (with :mod:`.marks`: regions, KV heads, gradient sync; :mod:`.sizes`: what a
  plan splits) -> :mod:`.feasibility` / :mod:`.checks` -> :mod:`.styles` (build) ->
  :mod:`.commit` -> :mod:`.prove` (with :mod:`.probes`: how the model is run; :mod:`.verdicts`:
  comparisons and blame): the steps of ``parallelize`` (:mod:`.apply`);
- :mod:`.certify`: a model on the meta device proved through a small replica;
- :mod:`.discover`: checked column -> row pairs of a model nothing declares;
- :mod:`.inventory`: what a resolved plan costs, per layer and collective, for the planner.

Importing this package loads nothing heavy; ``parallelize`` is ``tensorpar.parallelize``.
"""

"""tensorpar.sharding: plans and their application, from a model's declaration to its proof.

``parallelize`` (:mod:`.pipeline`) walks one way, each step a module handing a typed record
(:mod:`.records`) to the next: :mod:`.declare` -> :mod:`.resolve` -> :mod:`.check` -> :mod:`.place`
-> :mod:`.commit` -> :mod:`.prove`. Beside them:

- :mod:`.sizes`: a model's sizes from its config and attention modules;
- :mod:`.model_classes`: transformers' classes of a model type, a model on the meta device;
- :mod:`.replica`: tiny configs of any architecture, and the replica a model on the meta device
  is run and proved through;
- :mod:`.declared`: transformers' declared styles in tensorpar's;
- :mod:`.marks` (regions, KV heads, gradient sync), :mod:`.discover` (checked column -> row
  pairs of a model nothing declares): what ``resolve`` completes a plan with;
- :mod:`.styles` (:mod:`.param_styles`, :mod:`.spec`): every style a plan can name, with its builder;
- :mod:`.probes`, :mod:`.verdicts`: how the proof runs a model and judges a split;
- :mod:`.sequence`: sequence parallelism on a split model; :mod:`.audit`: replicas compared
  across ranks; :mod:`.parallelize_report`: what was done (``model.tp_report``);
- :mod:`.inventory`: what a resolved plan costs, per layer and collective, for the planner.

What tensorpar knows about each architecture is data in ``tensorpar.architecture``. Importing
this package loads nothing heavy; ``parallelize`` is ``tensorpar.parallelize``.
"""

"""tensorpar.architecture: what tensorpar knows about model architectures, torch-free.

Standard library only, at the bottom of the package map (docs/architecture.md): every other
package may read it, it reads none. One table per fact:

- :mod:`.registry`: each architecture's entry (its plan or overrides of its declared one, head
  attributes, units, blocks left whole, its tiny-model sizes, whether the lean decode path takes it);
- :mod:`.plans`: plans as data (module-name patterns, units, generic names);
- :mod:`.configs`: the config field names of each size, read from a config object or ``config.json``;
- :mod:`.layer_kinds`: the kinds of layer a configuration holds, and a small model holding each;
- :mod:`.tp_rules`: which tp sizes split a model and why (heads, KV heads, padding), what each
  rank holds;
- :mod:`.ring`: the bytes each rank sends in a collective (the ring formulas);
- :mod:`.tiny_sizes`: tiny-model sizes and the benchmark's model recipes.

Nothing is imported here: ``import tensorpar.architecture.ring`` loads only that module.
"""

"""Moved: ``tensorpar.models.tiny`` (tiny configs, models, checkpoints), ``tensorpar.sharding.model_classes``
(``config_class``, ``model_class``) and ``tensorpar.architecture.tiny_sizes`` (``BENCH_LLAMA``). These
names stay here only until ``tensorpar/sharding/inventory.py`` imports them from there."""
from tensorpar.architecture.tiny_sizes import BENCH_LLAMA  # noqa: F401
from tensorpar.models.tiny import make_tiny_checkpoint, make_tiny_config, make_tiny_model  # noqa: F401
from tensorpar.sharding.model_classes import config_class, model_class  # noqa: F401

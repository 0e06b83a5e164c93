"""The planner: memory, communication and time of a tensor-parallel layout, before running it.

Standard library only (no numpy, no torch). Every formula is a small function in one of

- :mod:`.hardware` accelerator presets (vendor datasheets) and custom devices,
- :mod:`.models` model shapes (gpt / llama families, presets); :mod:`.hfconfig` a Hugging Face ``config.json``,
- :mod:`.layout` tp x pp x dp, batch, recomputation, precision, ZeRO stage,
- :mod:`.params` parameter counts, whole and per rank,
- :mod:`.flops` model and hardware FLOPs (Narayanan et al. 2021; Korthikanti et al. 2022),
- :mod:`.memory` activations, KV cache, model states (Korthikanti et al. 2022; ZeRO),
- :mod:`.collectives` / :mod:`.comm` bytes per collective, and the collectives a layout issues,
- :mod:`.timing` lower bounds on time (and estimates, which are not bounds),
- :mod:`.feasibility` divisibility and memory checks with fixes and their cost,
- :mod:`.report` ``plan()``, and :mod:`.search` the layout search,
- :mod:`.hf` / :mod:`.predict` a Hugging Face model as tensorpar's runtime shards and runs it:
  parameters per rank and every collective it issues (``predict_collectives``);
- :mod:`.source` where a model comes from: a ModelSpec through its template
  (``tensorpar.architecture.templates``), or any ``config.json`` through ``tensorpar.sharding.
  inventory.MetaSource``; every figure of ``plan()`` and ``search()`` is read from the
  :class:`~tensorpar.architecture.split_model.SplitModel` it hands over (:mod:`.stages`,
  :mod:`.split_memory`, :mod:`.split_flops`, :mod:`.traffic`), and :mod:`.runtime` /
  :mod:`.mesh` predict from it what the runtime's ledger records (``predict_from_inventory``).
"""
from .comm import CommItem, dp_collectives, pp_collectives, tp_collectives, tp_layer_collectives
from .hardware import PRESETS as HARDWARE_PRESETS
from .hardware import Hardware, custom_hardware, get_hardware
from .hf import params_per_rank
from .hfconfig import from_hf_config, from_hf_dict
from tensorpar.architecture.split_model import ModelInventory, SplitModel
from .layout import Layout
from .models import PRESETS as MODEL_PRESETS
from .models import ModelSpec, get_model
from .params import count_params, param_breakdown, params_per_device
from .predict import PredictedCollective, RuntimePrediction, predict_collectives
from .profile import Profile, load as load_profile, published
from .report import PlanReport, plan
from .runtime import predict_from_inventory
from .search import SearchResult, search
from .source import ModelSource, TemplateSource
from .tp_search import TpSearch, search_tp

__all__ = [
    "CommItem", "HARDWARE_PRESETS", "Hardware", "Layout", "MODEL_PRESETS", "ModelInventory", "ModelSource",
    "ModelSpec", "PlanReport", "Profile", "TpSearch", "load_profile", "published", "search_tp", "PredictedCollective", "RuntimePrediction", "SearchResult", "SplitModel",
    "TemplateSource", "count_params", "custom_hardware", "dp_collectives", "from_hf_config", "from_hf_dict",
    "get_hardware", "get_model", "param_breakdown", "params_per_device", "params_per_rank", "plan",
    "pp_collectives", "predict_collectives", "predict_from_inventory", "search", "tp_collectives",
    "tp_layer_collectives",
]

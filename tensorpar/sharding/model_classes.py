"""transformers' classes of a model type: its config class, its LM class, a model built on the meta
device, and the experts loop that runs in float64. transformers is imported when one is asked for."""
from __future__ import annotations


def config_class(arch: str):
    """The transformers configuration class of ``model_type`` ``arch``; ValueError if unknown."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if arch not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"model type {arch!r} is not known to transformers {transformers.__version__}")
    return getattr(transformers, CONFIG_MAPPING_NAMES[arch])


def model_class(config, head: bool = True):
    """The causal-LM class of ``config`` (``head``; the masked-LM class of an encoder), else the bare model."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    kind = config.model_type
    if head:
        for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
            if kind in mapping:
                return getattr(transformers, mapping[kind])
    return getattr(transformers, auto.MODEL_MAPPING_NAMES[kind])


def meta_model(config, cls=None):
    """The model of ``config`` with its parameters on the meta device (no memory), in eval mode:
    of class ``cls``, else the one its config names (``architectures``), else :func:`model_class`'s."""
    import transformers
    from accelerate import init_empty_weights
    if cls is None:
        arch_name = (getattr(config, "architectures", None) or [None])[0]
        cls = (getattr(transformers, arch_name, None) if arch_name else None) or model_class(config)
    with init_empty_weights():
        model = cls(config)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def eager_experts(model):
    """Make a model's mixture-of-experts layers run transformers' eager experts loop, which takes
    float64 (its grouped-matmul kernel takes float32, bfloat16 and float16 only). Returns ``model``."""
    if hasattr(getattr(model, "config", None), "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model

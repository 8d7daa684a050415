"""The functional transformer: HF config -> frozen config, safetensors -> param pytree, forward."""

from models.config import ModelConfig, RopeConfig, UnsupportedModelError
from models.dense_cache import DenseKVCache, dense_attention
from models.loader import CheckpointError, load_params, load_params_sharded, weights_digest
from models.params import ParamSpec, abstract_params, init_params, param_specs, to_hf_tensors
from models.rope import apply_rope, inv_freq, rope_cos_sin
from models.transformer import forward, rms_norm

__all__ = [
    "CheckpointError", "DenseKVCache", "ModelConfig", "ParamSpec", "RopeConfig",
    "UnsupportedModelError", "abstract_params", "apply_rope", "dense_attention", "forward",
    "init_params", "inv_freq", "load_params", "load_params_sharded", "param_specs", "rms_norm", "rope_cos_sin",
    "to_hf_tensors", "weights_digest",
]

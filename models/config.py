"""DeepSeek-V3 model configuration: the Hugging Face `config.json` fields the reference model uses.

`ModelConfig` keeps DeepseekV3Config's field names so a config.json maps onto it one to one.
It reads both rope spellings (old `rope_scaling` + `rope_theta`, transformers-5 `rope_parameters`),
writes a dict DeepseekV3Config accepts, and says up front which tensor-parallel sizes fit.
Only what the reference model implements is accepted (YaRN or no rope scaling, sigmoid routing,
SiLU, no attention bias, MLA with every head its own key/value); anything else is a ValueError, and so
is a config.json that is not a JSON object, lacks the fields that give the model its size
(`REQUIRED_FIELDS`) or holds a value of the wrong type (`"hidden_size": "thirty-two"`, a negative size).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

#: Fields a config.json must name: without them it describes no model (an empty `{}` would silently
#: read as the full DeepSeek-V3 of DeepseekV3Config's defaults).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
#: The config.json model types and architectures that are DeepSeek-V3's architecture (Kimi-K2 keeps it).
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
#: Integer fields that may be 0 (every other integer size must be at least 1).
ZERO_ALLOWED = frozenset({"n_shared_experts", "first_k_dense_replace"})


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling parameters, as in a checkpoint's `rope_scaling` / `rope_parameters`.

    `mscale`, `mscale_all_dim` and `attention_factor` keep transformers' meaning, None included:
    None means "absent from the config", which changes how the cos/sin factor is derived.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def cos_sin_factor(self) -> float:
        """Factor applied to the rotary cos/sin tables (transformers' `attention_factor`)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """Factor applied to the attention softmax scale (DeepSeek's mscale_all_dim correction)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context extension of `scale`."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a DeepSeek-V3-architecture model (DeepseekV3Config names).

    Defaults are DeepseekV3Config's defaults, so a sparse config.json reads the same way
    transformers reads it.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        problems = _type_problems(self)
        if problems:  # the checks below do arithmetic on these values
            raise ValueError("unsupported DeepSeek-V3 config: " + "; ".join(problems))
        if self.scoring_func != "sigmoid":
            problems.append(f"scoring_func {self.scoring_func!r} (only 'sigmoid' is implemented)")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} (only 'silu' is implemented)")
        if self.n_routed_experts % self.n_group:
            problems.append(f"n_group {self.n_group} does not divide n_routed_experts {self.n_routed_experts}")
        elif self.n_routed_experts // self.n_group < 2:
            problems.append("each expert group needs at least 2 experts (group score = sum of its top 2)")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        elif self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            problems.append("num_experts_per_tok exceeds the experts in the selected groups")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if problems:
            raise ValueError("unsupported DeepSeek-V3 config: " + "; ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: the no-position part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale: 1/sqrt(qk_head_dim), times YaRN's mscale_all_dim correction."""
        scale = self.qk_head_dim**-0.5
        return scale * self.rope_scaling.softmax_scale_factor() if self.rope_scaling else scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True if decoder layer `layer_idx` has a mixture-of-experts block (else a dense MLP)."""
        return layer_idx >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        """How many decoder layers have a mixture-of-experts block."""
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    def check_tensor_parallel(self, world_size: int) -> None:
        """Raise ValueError naming every dimension that `world_size` ranks cannot split evenly."""
        dims = {"num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size}
        if self.first_k_dense_replace > 0:
            dims["intermediate_size"] = self.intermediate_size
        if self.num_moe_layers > 0:
            dims["moe_intermediate_size"] = self.moe_intermediate_size
        bad = [f"{name} ({size})" for name, size in dims.items() if size % world_size]
        if bad:
            raise ValueError(f"tensor parallel size {world_size} does not divide " + ", ".join(bad))

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor in a Hugging Face checkpoint of this model (per-expert names).

        Excludes what this model does not use: multi-token-prediction layers, rotary buffers, and
        `lm_head.weight` when embeddings are tied.
        """
        hidden, heads = self.hidden_size, self.num_attention_heads
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, hidden)}
        for i in range(self.num_hidden_layers):
            layer = f"model.layers.{i}"
            shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
            shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
            attn = f"{layer}.self_attn"
            if self.q_lora_rank is None:
                shapes[f"{attn}.q_proj.weight"] = (heads * self.qk_head_dim, hidden)
            else:
                shapes[f"{attn}.q_a_proj.weight"] = (self.q_lora_rank, hidden)
                shapes[f"{attn}.q_a_layernorm.weight"] = (self.q_lora_rank,)
                shapes[f"{attn}.q_b_proj.weight"] = (heads * self.qk_head_dim, self.q_lora_rank)
            shapes[f"{attn}.kv_a_proj_with_mqa.weight"] = (self.kv_lora_rank + self.qk_rope_head_dim, hidden)
            shapes[f"{attn}.kv_a_layernorm.weight"] = (self.kv_lora_rank,)
            shapes[f"{attn}.kv_b_proj.weight"] = (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
            shapes[f"{attn}.o_proj.weight"] = (hidden, heads * self.v_head_dim)
            mlp = f"{layer}.mlp"
            if not self.is_moe_layer(i):
                shapes.update(_gated_mlp_shapes(mlp, hidden, self.intermediate_size))
                continue
            shapes[f"{mlp}.gate.weight"] = (self.n_routed_experts, hidden)
            shapes[f"{mlp}.gate.e_score_correction_bias"] = (self.n_routed_experts,)
            for e in range(self.n_routed_experts):
                shapes.update(_gated_mlp_shapes(f"{mlp}.experts.{e}", hidden, self.moe_intermediate_size))
            shared = self.moe_intermediate_size * self.n_shared_experts
            shapes.update(_gated_mlp_shapes(f"{mlp}.shared_experts", hidden, shared))
        shapes["model.norm.weight"] = (hidden,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, hidden)
        return shapes

    def num_parameters(self) -> int:
        """Total parameter count of the model (all ranks together, no multi-token prediction)."""
        return sum(math.prod(shape) for shape in self.hf_tensor_shapes().values())

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Config from a Hugging Face config.json dict (old or transformers-5 rope spelling).

        A multimodal wrapper's config (Kimi-K2.5: `KimiK25ForConditionalGeneration` with the
        DeepSeek-V3 text model in `text_config`) gives its text model's config.
        """
        if not isinstance(hf, dict):
            raise ValueError(f"config.json must hold a JSON object, not a {_json_type(hf)}")
        if "text_config" in hf:
            if not isinstance(hf["text_config"], dict):
                raise ValueError(f"text_config must be a JSON object, not a {_json_type(hf['text_config'])}")
            hf = hf["text_config"]
        model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
        if (model_type is not None or architectures) and model_type not in SUPPORTED_MODEL_TYPES and \
                not set(architectures) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(f"config.json is of model_type {model_type!r} (architectures {', '.join(architectures) or 'none'}): "
                             f"fxfuse's reference model is DeepSeek-V3's, and reads model_type {' or '.join(SUPPORTED_MODEL_TYPES)} "
                             f"({', '.join(SUPPORTED_ARCHITECTURES)}; Kimi-K2.5's wrapper through its text_config)")
        missing = [name for name in REQUIRED_FIELDS if name not in hf]
        if missing:
            raise ValueError(f"config.json has no {', '.join(missing)}: not a DeepSeek-V3 model config")
        if hf.get("num_key_value_heads") not in (None, hf.get("num_attention_heads", cls.num_attention_heads)):
            raise ValueError("MLA needs num_key_value_heads == num_attention_heads")
        if hf.get("attention_bias"):
            raise ValueError("attention_bias=True is not implemented")
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"topk_method {hf['topk_method']!r} is not implemented (only 'noaux_tc')")
        names = {f.name for f in fields(cls)} - {"rope_theta", "rope_scaling"}
        values = {name: hf[name] for name in names if name in hf}
        rope_theta, rope_scaling = _read_rope(hf)
        return cls(**values, rope_theta=rope_theta, rope_scaling=rope_scaling)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "ModelConfig":
        """Config from `directory/config.json`."""
        with open(Path(directory) / "config.json") as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers' DeepseekV3Config reads back as this model.

        Rope is written in both spellings (identical content) so transformers 4.x and 5.x agree.
        """
        hf = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_scaling"}
        if self.rope_scaling is None:
            rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
            rope_scaling = None
        else:
            yarn = {k: v for k, v in asdict(self.rope_scaling).items() if v is not None}
            rope_parameters = {"rope_type": "yarn", "rope_theta": self.rope_theta, **yarn}
            rope_scaling = {"type": "yarn", "rope_type": "yarn", **yarn}
        hf.update(
            model_type="deepseek_v3",
            architectures=["DeepseekV3ForCausalLM"],
            num_key_value_heads=self.num_attention_heads,
            attention_bias=False,
            topk_method="noaux_tc",
            num_nextn_predict_layers=0,
            rope_parameters=rope_parameters,
            rope_scaling=rope_scaling,
        )
        return hf


def _read_rope(hf: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from either rope spelling of a config.json dict."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling / rope_parameters must be a JSON object, not a {_json_type(params)}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type!r} is not implemented (only 'yarn' or none)")
    if params.get("factor") is None:
        raise ValueError("yarn rope scaling needs a 'factor'")
    return theta, YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _type_problems(config: ModelConfig) -> list[str]:
    """What is wrong with the types of `config`'s values: integers (sizes at least 1, or 0 where
    `ZERO_ALLOWED`), finite numbers, booleans and strings as the field annotations say."""
    problems = []
    for f in fields(config):
        value = getattr(config, f.name)
        kind = f.type.replace(" | None", "")
        if value is None and f.type.endswith("| None"):
            continue
        if kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(f"{f.name} {value!r} must be an integer")
            elif value < (0 if f.name in ZERO_ALLOWED else 1):
                problems.append(f"{f.name} {value} must be at least {0 if f.name in ZERO_ALLOWED else 1}")
        elif kind == "float" and (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)):
            problems.append(f"{f.name} {value!r} must be a finite number")
        elif kind == "bool" and not isinstance(value, bool):
            problems.append(f"{f.name} {value!r} must be true or false")
        elif kind == "str" and not isinstance(value, str):
            problems.append(f"{f.name} {value!r} must be a string")
    return problems


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type: object, list, string, number, boolean or null."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _gated_mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes of one SwiGLU block's gate/up/down projections under `prefix`."""
    return {
        f"{prefix}.gate_proj.weight": (intermediate, hidden),
        f"{prefix}.up_proj.weight": (intermediate, hidden),
        f"{prefix}.down_proj.weight": (hidden, intermediate),
    }

"""One typed config tree: defaults here, a YAML recipe sets what differs, `key=value` overrides last.

An unknown key or a value of the wrong type is an error that names the key and what was expected (for
an unknown key, the nearest valid key of its section too). The nodes
live in the modules beside this one, grouped by what they configure; everything is importable from here.
"""

from furlong.config.base import BUNDLED_TASKS, RECIPES, REPO_ROOT
from furlong.config.distill import DistillConfig, TeacherConfig
from furlong.config.engines import HFEngineConfig, RayConfig, SGLangConfig, SyncConfig, VLLMConfig
from furlong.config.env import EnvConfig, LogConfig, PromptsConfig, RewardConfig, TrainEvalConfig, WandbConfig
from furlong.config.load import Config, ConfigError, load_config
from furlong.config.policy import (
    DEFAULT_FAMILIES,
    DEFAULT_RL_FAMILIES,
    DEFAULT_SFT_FAMILIES,
    DEFAULT_SYSTEM_PROMPT,
    AgentConfig,
    FSDP2Config,
    LoraConfig,
    ModelConfig,
    RLConfig,
    SFTConfig,
)
from furlong.config.sandbox import EvalConfig, ImagesConfig, OpenEnvConfig, SandboxConfig
from furlong.config.train import TrainConfig

__all__ = [
    "BUNDLED_TASKS",
    "DEFAULT_FAMILIES",
    "DEFAULT_RL_FAMILIES",
    "DEFAULT_SFT_FAMILIES",
    "DEFAULT_SYSTEM_PROMPT",
    "RECIPES",
    "REPO_ROOT",
    "AgentConfig",
    "Config",
    "ConfigError",
    "DistillConfig",
    "EnvConfig",
    "EvalConfig",
    "FSDP2Config",
    "HFEngineConfig",
    "ImagesConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "OpenEnvConfig",
    "PromptsConfig",
    "RLConfig",
    "RayConfig",
    "RewardConfig",
    "SFTConfig",
    "SGLangConfig",
    "SandboxConfig",
    "SyncConfig",
    "TeacherConfig",
    "TrainConfig",
    "TrainEvalConfig",
    "VLLMConfig",
    "WandbConfig",
    "load_config",
]

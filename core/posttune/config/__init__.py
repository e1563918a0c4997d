"""Configuration: YAML files, command-line overrides, validation and ``_component_`` objects."""

from posttune.config.components import instantiate
from posttune.config.loader import apply_overrides, load_config, load_yaml
from posttune.config.schema import RunConfig, validate

__all__ = ["RunConfig", "apply_overrides", "instantiate", "load_config", "load_yaml", "validate"]

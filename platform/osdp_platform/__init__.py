"""osdp-platform: recipes in, OSDP-planned FSDP2 training on Ray out, tracked in MLflow."""

__version__ = "0.1.0"

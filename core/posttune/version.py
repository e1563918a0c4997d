"""The version of the posttune distribution (its own module: the plugin manager reads it without importing
the package root, which imports the plugin manager)."""

__version__ = "0.1.0"

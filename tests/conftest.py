"""Shared test setup. posttune's own fixtures come from the `posttune.testing` pytest plugin."""

import os

# Tests never reach a hub; fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

"""Shared test setup. posttune's own fixtures come from the `posttune.testing` pytest plugin."""

import os

# Tests never reach a hub; fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# `posttune train` children run on glibc's malloc wherever the suite runs (a machine with jemalloc would
# otherwise preload it): the memory tests' figures are glibc's; tests/e2e/test_allocator.py sets its own choice.
os.environ.setdefault("POSTTUNE_ALLOCATOR", "system")

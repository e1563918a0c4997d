"""posttune-scaffold: `posttune new plugin NAME --kind KIND`, a plugin distribution from a working example.

    pip install -c constraints.txt ./plugins/scaffold
    posttune new plugin my-method --kind method

A tool for plugin authors, not part of a training run, so it is a distribution of its own (as
`posttune eval` and `posttune quantize` are). Importing this module does not import torch.
"""

from __future__ import annotations

from posttune import hookimpl

from posttune_scaffold.command import COMMAND

POSTTUNE_PLUGIN_API = 2
__version__ = "0.1.0"


@hookimpl
def posttune_register_commands(cli):
    cli(COMMAND)

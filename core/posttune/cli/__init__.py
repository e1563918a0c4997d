"""The `posttune` command line. Every subcommand, the core's own included, is a registered Command."""

"""The core's own plugins, registered through the same hooks as installed ones."""

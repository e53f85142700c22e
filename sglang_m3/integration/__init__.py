"""Glue between SGLang's internals and the project's components (the functions plugin.HOOKS installs)."""

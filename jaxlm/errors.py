"""Errors raised by jaxlm for bad input."""


class JaxlmError(ValueError):
    """Base class of the errors jaxlm raises for bad input: files, configs and requests."""


class LoadError(JaxlmError):
    """A model file or directory is missing, corrupt or unsupported."""


class PlanError(JaxlmError):
    """A memory plan cannot hold what was asked of it."""

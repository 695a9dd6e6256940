"""The error every adapter refusal raises (a 400 at the server)."""


class LoRAError(ValueError):
    """An adapter that cannot be served on this model / engine (a 400 at the server)."""

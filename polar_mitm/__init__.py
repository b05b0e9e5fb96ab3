"""polar-mitm: token-faithful training data from unmodified agent harnesses, captured at the HTTPS boundary."""

__version__ = "0.1.0"

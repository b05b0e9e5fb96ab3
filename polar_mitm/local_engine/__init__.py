"""A real vLLM engine on this machine (CPU), used as the upstream of tests and the demo."""

from polar_mitm.local_engine.serve import LocalEngine

__all__ = ["LocalEngine"]

"""The README's engine hook for the tiny random-weight test model, by file path
(`--engine-hook examples/steer_tiny_model.py:steer`, from the checkout root).

It is `polar_mitm.local_engine.steering:steer` (read it there), which works from any folder:
`--engine-hook polar_mitm.local_engine.steering:steer`. A real policy needs no hook.
"""

from polar_mitm.local_engine.steering import FINAL_TEXT, STEER_LINE, steer

__all__ = ["FINAL_TEXT", "STEER_LINE", "steer"]

"""mitmdump -s addons/polar.py --set polar_upstream=http://127.0.0.1:8011/v1 --set polar_db=polar.duckdb

A thin script: the addon lives in polar_mitm.gateway.addon.
"""

from polar_mitm.gateway import contentview
from polar_mitm.gateway.addon import PolarAddon

contentview.register()  # mitmweb -s addons/polar.py: the "LLM" view of model calls
addons = [PolarAddon()]

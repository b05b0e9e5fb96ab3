"""mitmdump -s addons/polar.py --set polar_upstream=http://127.0.0.1:8011/v1 --set polar_db=polar.duckdb

A thin script: the addon lives in polar_mitm.gateway.addon.
"""

from polar_mitm.gateway.addon import PolarAddon

addons = [PolarAddon()]

"""mitmdump --listen-host 127.0.0.1 -s addons/polar.py \
    --set polar_upstream=http://127.0.0.1:8011/v1 --set polar_db=polar.duckdb

mitmdump listens on every interface by default: the addon then refuses to start unless polar_control_token is set
(its /control/* would be open to the network), so name a loopback --listen-host, or set a token.

A thin script: the addon lives in polar_mitm.gateway.addon.
"""

from polar_mitm.gateway import contentview
from polar_mitm.gateway.addon import PolarAddon

contentview.register()  # mitmweb -s addons/polar.py: the "LLM" view of model calls
addons = [PolarAddon()]

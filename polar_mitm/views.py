"""Moved to polar_mitm.store.views (the store's documented SQL views); this name keeps old imports working."""

from polar_mitm.store.views import MATERIAL, TRAJECTORIES, VIEWS, View, create_views

__all__ = ["MATERIAL", "TRAJECTORIES", "VIEWS", "View", "create_views"]

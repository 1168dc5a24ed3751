"""Azure resources of the lab: one ComponentResource per concept, specs built by pure functions."""

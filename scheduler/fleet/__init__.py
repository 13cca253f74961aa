"""Many executors: the fleet, routing, discovery, KV-event following, migration, disaggregation."""

"""Discrete-event cluster simulator reusing the coordinator core, the co-scheduler and the routing policy."""

"""Converters from public datasets to the local dataset format (collm_common.data)."""

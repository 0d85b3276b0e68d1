"""Serving: the process around the engines, without HTTP.

The model registry (load, unload, references), devices ("dies") and their budgets, Prometheus
metrics, registration with an SMG router and the `pantheon router` command, and the multi-host
cluster (`distributed`).
"""

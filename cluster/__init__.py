"""Cluster-facing pieces: storage roots, spot handling, metrics. Imports nothing from trainers/ or service/."""

"""Rehearse ray_cluster.yaml on one machine: fresh nodes in network namespaces, `ray up` for real.

See ``cluster.rehearsal.cloud`` for what a node is, ``cluster.rehearsal.render`` for the only
changes made to the AWS file, and the README's cluster walk-through for what the rehearsal
proves and what only a real cloud can.
"""

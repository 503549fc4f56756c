"""The job spec, validated once at the edge; one module per concern, each name imported from its own.

- ``job``: the spec's sections and ``JobSpec``, the rules that span sections, which keys exist.
- ``fields``: what every section shares: unknown keys refused, ``pkg.module:fn`` references
  checked (or, for the service, only their shape), free-form options kept small.
- ``prices``: the cost section and its illustrative instance prices.
- ``batching``: what each worker does for a global batch at a given world size.
- ``parsing``: JSON or YAML text into a mapping, bounded against hostile input.
- ``loading``: a spec file (local or in storage, digest-checked) with overrides, validated.
- ``errors``: ``SpecError`` and pydantic's errors as ``field.path: value: problem: fix`` lines.
"""

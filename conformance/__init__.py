"""A conformance suite for the device protocol (docs/protocol), independent of the product's code.

It drives a live server through the whole device flow with a pluggable device ``Client`` (conformance.client)
and checks every message the server sends against the JSON Schemas in docs/protocol/schemas. It uses only the
standard library, ``cryptography``, ``websockets``, ``jsonschema`` and ``rfc8785``: see conformance/README.md.
"""

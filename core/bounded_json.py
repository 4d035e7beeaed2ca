"""JSON from outside the server, parsed with a limit on how deeply it nests.

Python's ``json`` recurses once per level of nesting: a body of a few kilobytes of ``[`` raises RecursionError,
which no caller expects (a 500 on the REST API, a socket dropped without a close code). The server parses with
the agent's own bounded parser (``edge_agent.bounded_json``: brackets counted outside strings without recursing,
anything nested deeper than ``MAX_JSON_DEPTH`` refused before ``json.loads`` sees it), so both ends of the
protocol hold the same limit. Every message of the protocol and every API body nests a few levels; 64 leaves room
for any of them.

The DRF parser (``core.api.parsers.BoundedJSONParser``, the default in settings) and the agent socket
(``devices.consumers``) parse through it.
"""

from edge_agent.bounded_json import MAX_JSON_DEPTH, JSONTooDeep, json_depth, loads

__all__ = ["MAX_JSON_DEPTH", "JSONTooDeep", "json_depth", "loads"]

"""Shared REST API machinery: error bodies, pagination, the /api/v1/ router."""

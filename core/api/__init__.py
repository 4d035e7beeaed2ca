"""Shared REST helpers: the error body and exception handler, strict serializers, filters, pagination, schema."""

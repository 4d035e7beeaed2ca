"""The core every app builds on: settings helpers, the API's errors, serializers, filters and pagination,
domain errors, the live event bus and the async bridge. It imports no app of this project (docs/architecture.md)."""

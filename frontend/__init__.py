"""The operator dashboard: server-rendered pages and the live-update WebSocket."""

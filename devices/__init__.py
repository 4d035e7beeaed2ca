"""The fleet: devices, cohorts, enrollment, device identity and auth, heartbeats, the agent WebSocket."""

"""Operator accounts: users with a role (viewer, operator, admin) and API tokens for integrations."""

"""Tenants, their API tokens, and how a request authenticates as a tenant."""

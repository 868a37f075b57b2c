"""Fakes of what lies outside the system: model providers and third-party agents."""
